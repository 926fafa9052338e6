"""lm-eval (0.4.13) against `brrr serve`: `local-completions` through the server scores a local task file the same
as lm-eval's own `hf` backend on the same checkpoint, per request (each loglikelihood within 1e-4) and per task,
for loglikelihood, multiple-choice and generate_until tasks; its remote tokenizer (auto-detected through
/tokenizer_info and /tokenize) is brrr's. A server that scored prompts at chance (no echoed logprobs) fails here.
`local-chat-completions` (generate_until only: lm-eval sends chat messages, which carry no loglikelihoods) through
/v1/chat/completions generates what the `hf` backend generates from the same chat template."""
import json
import os
import random

import pytest

from tests.server.conftest import CLIENTS_MODEL

# the task files are local and the checkpoint is on disk: nothing may be fetched (read when datasets is imported)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")  # a [test] dependency; skipped where it is not installed

WORDS = "the a cat dog sat ran on in under over mat box red blue big small one two".split()
TASKS = ("brrr_mc", "brrr_ll", "brrr_gen")


def _task_files(root) -> None:
    rng = random.Random(0)

    def phrase(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = {
        "mc": [{"question": phrase(5), "choices": [phrase(rng.randint(1, 3)) for _ in range(4)],
                "label": rng.randrange(4)} for _ in range(24)],
        "ll": [{"context": phrase(rng.randint(0, 6)), "continuation": " " + phrase(rng.randint(1, 4))}
               for _ in range(24)],
        "gen": [{"prompt": phrase(4), "answer": phrase(2)} for _ in range(8)],
    }
    for name, docs in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\ntest_split: test\n")
    (root / "brrr_mc.yaml").write_text(
        "task: brrr_mc\n" + common.format(file=root / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    # an empty context is a row too: lm-eval then scores the continuation after the end-of-text token
    (root / "brrr_ll.yaml").write_text(
        "task: brrr_ll\n" + common.format(file=root / "ll.jsonl") +
        "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    (root / "brrr_gen.yaml").write_text(
        "task: brrr_gen\n" + common.format(file=root / "gen.jsonl") +
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def _evaluate(model, model_args, task_manager, tasks=TASKS, chat=False):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), log_samples=True,
                                   task_manager=task_manager, batch_size=1,
                                   apply_chat_template=chat, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def _responses(results, task):
    """Per request, in document order: (loglikelihood, is_greedy) pairs, or generated text."""
    docs = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] for r in s["resps"]] for s in docs]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """lm-eval's index of its own tasks and the local ones, built once (it reads every task file lm-eval ships,
    seconds a time)."""
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("lm-eval-tasks")
    _task_files(root)
    return TaskManager(include_path=str(root))


@pytest.fixture(scope="module")
def both(task_manager, clients_server, plain_model_dir):
    served = _evaluate("local-completions", f"model={CLIENTS_MODEL},base_url={clients_server.base_url}"
                       "/v1/completions,num_concurrent=4,max_retries=1,tokenized_requests=True", task_manager)
    # lm-eval's hf backend prepends the tokenizer's BOS unless told not to, and puts BOS before an empty context;
    # its API backends (against vLLM too) add nothing and put end-of-text there: the same token ids on both sides
    # need hf's add_bos_token=False and prefix_token_id=EOS
    eos = clients_server.llm.tokenizer.eos_token_id
    reference = _evaluate("hf", f"pretrained={plain_model_dir},dtype=float32,device=cpu,add_bos_token=False,"
                          f"prefix_token_id={eos}", task_manager)
    return served, reference


def test_remote_tokenizer_is_detected(clients_server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = clients_server.base_url + "/v1/completions"
    assert check_remote_tokenizer_support(url)
    remote, ours = RemoteTokenizer(url), clients_server.llm.tokenizer
    assert remote.eos_token == ours.special_tokens["eos_token"] and remote.eos_token_id == ours.eos_token_id
    text = "def add(a, b): return a + b"
    assert remote.encode(text) == ours.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    assert remote.tokenizer_info["model_max_length"] == clients_server.llm.max_model_len


@pytest.mark.parametrize("task", ["brrr_mc", "brrr_ll"])
def test_loglikelihoods_equal_the_hf_backend(both, task):
    served, reference = both
    got, want = _responses(served, task), _responses(reference, task)
    assert len(got) == len(want) == 24
    for doc_got, doc_want in zip(got, want):
        assert len(doc_got) == len(doc_want)
        for (ll, greedy), (ll_ref, greedy_ref) in zip(doc_got, doc_want):
            assert ll == pytest.approx(ll_ref, abs=1e-4) and ll < 0
            assert greedy == greedy_ref
    for metric, value in reference["results"][task].items():
        if isinstance(value, float) and "stderr" not in metric:
            # perplexity is exp(-mean loglikelihood): relative, where the loglikelihoods agree within 1e-4
            assert served["results"][task][metric] == pytest.approx(value, rel=1e-4, abs=1e-4), metric


def test_generate_until_equals_the_hf_backend(both):
    served, reference = both
    assert _responses(served, "brrr_gen") == _responses(reference, "brrr_gen")
    assert served["results"]["brrr_gen"]["exact_match,none"] == reference["results"]["brrr_gen"]["exact_match,none"]


def test_chat_completions_generate_what_the_hf_backend_does_from_the_chat_template(task_manager, clients_server,
                                                                                   plain_model_dir):
    """lm-eval's chat backend sends each prompt as a user message; brrr renders the checkpoint's chat template
    (BOS first) and generates greedily up to the task's stop string. The hf backend renders the same template with
    transformers and, seeing BOS at the start, adds no second one: the same token ids on both sides."""
    served = _evaluate("local-chat-completions", f"model={CLIENTS_MODEL},base_url={clients_server.base_url}"
                       "/v1/chat/completions,num_concurrent=4,max_retries=1", task_manager, ("brrr_gen",), chat=True)
    reference = _evaluate("hf", f"pretrained={plain_model_dir},dtype=float32,device=cpu", task_manager,
                          ("brrr_gen",), chat=True)
    docs = sorted(served["samples"]["brrr_gen"], key=lambda s: s["doc_id"])
    # the request is chat messages, not text: lm-eval's chat path ran, not the completions one
    sent = [json.loads(d["arguments"][0][0][0]) for d in docs]  # (JsonChatStr(messages), generation kwargs)
    assert sent == [[{"role": "user", "content": d["doc"]["prompt"]}] for d in docs] and len(sent) == 8, sent
    got, want = _responses(served, "brrr_gen"), _responses(reference, "brrr_gen")
    assert got == want and any(text for (text,) in got), (got, want)  # not all empty: generated text is compared
    assert served["results"]["brrr_gen"]["exact_match,none"] == reference["results"]["brrr_gen"]["exact_match,none"]
