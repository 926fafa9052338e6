"""bench/gemv_balance.py's plain-read ceiling: a kernel that skipped bytes would overstate the bandwidth the GEMVs
are held against, so each program's sum must cover exactly its run of words."""
import pathlib

import torch


def test_read_kernel_sums_every_word_once(device, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from gemv_balance import _read_kernel

    words, programs, per = 5000, 3, 2048  # the last program's run is partial (904 words)
    w = torch.randint(-1000, 1000, (words,), dtype=torch.int32, device=device)
    out = torch.empty(programs, dtype=torch.int32, device=device)
    _read_kernel[(programs,)](w, out, words, per, BLOCK=1024, num_warps=4)
    want = torch.stack([w[p * per:(p + 1) * per].sum() for p in range(programs)]).to(torch.int32)
    assert torch.equal(out, want)
