"""The quantized matmuls' tuner: candidates are timed only inside `quant_tuning` (the engine's warm-up); after it a
shape's bucket that was never tuned takes the nearest tuned bucket's config, or the default, without timing.

Under Triton's interpreter nothing is timed unless a timer is passed in, so these tests pass a spy: it records
every call and ranks the candidates by a preference, without running them."""
import pytest
import torch

from brrr.kernels import quant as qm
from brrr.cache_dir import cache_dir
from brrr.kernels.quant import tune

GROUP, N, GROUPS = 32, 40, 5


class Spy:
    """A timer that prefers `pick(cfg)` configs (1 ms, else 2 ms) and counts its calls."""

    def __init__(self, pick):
        self.pick, self.calls = pick, 0

    def __call__(self, run, cfg, copies):
        self.calls += 1
        return 1.0 if self.pick(cfg) else 2.0


@pytest.fixture
def problem(device):
    """An int4 g32 layer in bf16 (fp32 never tunes: it always runs the default)."""
    g = torch.Generator().manual_seed(0)
    k = GROUP * GROUPS
    codes = torch.randint(0, 16, (N, k), generator=g)
    scales = (torch.rand(GROUPS, N, generator=g) * 0.1 + 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (GROUPS, N), generator=g).to(torch.uint8)
    weight = [t.to(device) for t in (qm.pack_int4_kernel(codes, GROUP), scales, zeros)]
    qm.TUNED_CONFIGS.clear()
    yield weight, torch.randn(600, k, generator=g).to(torch.bfloat16).to(device)
    qm.TUNED_CONFIGS.clear()


def _matmul_close(x, weight):
    got = qm.w4a16_matmul_triton(x, *weight, GROUP)
    want = qm.w4a16_matmul_ref(x.float(), weight[0], weight[1].float(), weight[2], GROUP)
    assert ((got.float() - want).norm() / want.norm()) < 1e-2


def test_untuned_buckets_take_the_nearest_tuned_config_without_timing(problem):
    weight, x = problem
    mid = dict(qm.w4_configs(17, GROUP)[len(qm.CANDIDATES.tiled) + 1])  # a mid-M tile, 64 x 64
    dequant = dict(qm.DEQUANT)
    with qm.quant_tuning(timer=Spy(lambda c: c == mid)) as small:
        _matmul_close(x[:17], weight)  # bucket 32
    with qm.quant_tuning(timer=Spy(lambda c: c == dequant)) as large:
        _matmul_close(x[:200], weight)  # bucket 256
    [at_32], [at_256] = small.shapes, large.shapes
    assert (at_32.bucket, at_32.config, at_256.bucket, at_256.config) == (32, mid, 256, dequant)
    assert [c for c, _ in at_32.timings] == qm.w4_configs(17, GROUP) and at_32.shape == at_256.shape

    after = Spy(lambda c: True)

    def config(m):
        return qm.TUNED_CONFIGS.config(x.device, at_32.shape, m, lambda: qm.w4_configs(m, GROUP), after, weight[0])

    # outside a tuning block: 64 rows are nearer 32 than 256 (in log2), 500 nearer 256; 3 rows (a GEMV bucket of
    # its own) get no tuned config among their candidates, so the default
    assert (config(40), config(500), config(3)) == (mid, dequant, qm.w4_configs(3, GROUP)[0])
    for m in (40, 500, 3):
        _matmul_close(x[:m], weight)
    assert after.calls == 0

    with qm.quant_tuning(timer=after) as again:  # a new bucket is tuned in the next warm-up, a tuned one is not
        _matmul_close(x[:40], weight)
        _matmul_close(x[:17], weight)
    assert [s.bucket for s in again.shapes] == [64] and after.calls == len(qm.w4_configs(40, GROUP))
    assert config(40) == again.shapes[0].config


@pytest.mark.skipif(not tune.INTERPRETED, reason="on the GPU the default timer times")
def test_nothing_is_timed_under_the_interpreter_without_a_timer(problem):
    weight, x = problem
    with qm.quant_tuning() as report:
        _matmul_close(x[:2], weight)
    assert report.shapes == []


def test_buckets_are_named_by_their_largest_m():
    assert [tune.bucket(m) for m in (1, 2, 4, 5, 16, 17, 32, 33, 8192, 9000)] == [1, 2, 4, 16, 16, 32, 32, 64, 8192,
                                                                                    8192]


def test_bucket_sizes_meet_every_bucket_once():
    """A warm-up running these token counts meets every bucket up to its budget, each once."""
    assert tune.bucket_sizes(2048) == [1, 2, 3, 4, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert tune.bucket_sizes(300) == [1, 2, 3, 4, 16, 32, 64, 128, 256, 300]
    assert tune.bucket_sizes(3) == [1, 2, 3] and tune.bucket_sizes(20000)[-1] == 8192
    for budget in (1, 7, 100, 5000, 20000):
        sizes = tune.bucket_sizes(budget)
        assert {tune.bucket(m) for m in range(1, budget + 1)} == {tune.bucket(m) for m in sizes}
        assert len({tune.bucket(m) for m in sizes}) == len(sizes) and max(sizes) <= budget


def test_tuned_picks_are_written_at_once_and_reused_by_the_next_process(tmp_path, caplog):
    """A pick is on disk as soon as it is made (a warm-up cut short keeps it); a new TunedConfigs over the same
    directory (the next process) takes it without timing anything; a torn file is ignored and tuned again."""
    cpu, shape = torch.device("cpu"), ("w4", 64, 128, 32, torch.bfloat16)
    configs = [{"BLOCK_N": n} for n in (16, 32, 64)]
    first = tune.TunedConfigs(tune.TunedConfigStore(str(tmp_path), devices=("cpu",)))
    spy = Spy(lambda c: c["BLOCK_N"] == 32)
    with first.tuning(timer=spy):
        assert first.config(cpu, shape, 1, lambda: configs, None) == {"BLOCK_N": 32}
        [path] = list(tmp_path.iterdir())  # written before the session ends
        assert tune.sources_fingerprint() in path.name and spy.calls == 3

    second = tune.TunedConfigs(tune.TunedConfigStore(str(tmp_path), devices=("cpu",)))
    again = Spy(lambda c: c["BLOCK_N"] == 64)
    with second.tuning(timer=again) as report:
        assert second.config(cpu, shape, 1, lambda: configs, None) == {"BLOCK_N": 32}
        assert second.config(cpu, shape, 16, lambda: configs, None) == {"BLOCK_N": 64}  # a new bucket is timed
    assert again.calls == 3 and [s.bucket for s in report.shapes] == [16]
    assert tune.TunedConfigStore._read(str(path))[repr(shape)] == {1: {"BLOCK_N": 32}, 16: {"BLOCK_N": 64}}

    path.write_text('{"torn')
    third = tune.TunedConfigs(tune.TunedConfigStore(str(tmp_path), devices=("cpu",)))
    with third.tuning(timer=Spy(lambda c: c["BLOCK_N"] == 16)), caplog.at_level("WARNING"):
        assert third.config(cpu, shape, 1, lambda: configs, None) == {"BLOCK_N": 16}
    assert "ignoring the tuned-config file" in caplog.text


def test_the_default_store_writes_nothing_for_a_cpu_device(tmp_path, monkeypatch):
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    configs = tune.TunedConfigs()
    with configs.tuning(timer=Spy(lambda c: True)):
        configs.config(torch.device("cpu"), ("w8", 8, 8), 1, lambda: [{"a": 1}, {"a": 2}], None)
    assert list(tmp_path.iterdir()) == []
    assert cache_dir() == str(tmp_path)
