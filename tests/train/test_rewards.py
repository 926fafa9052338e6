"""GRPO's reward functions: the built-ins (exact answer, regex format, JSON schema through the grammar engine,
valid Python), several summed with weights (None left out), and a function that raises or returns the wrong
thing fails with its name and the completion/row it failed on."""
import math

import pytest
import torch

from brrr.default_model import default_model_dir
from brrr.errors import BrrrError
from brrr.tokenizer import Tokenizer
from brrr.train.rewards import Rewards, load_reward


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


def test_builtins(tokenizer):
    comps = ['{"a": 1}', '{"a": "x"}', "x = (", "42\n"]
    ids = [tokenizer.encode(c, add_special_tokens=False) for c in comps]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rows = [{"answer": "42", "pattern": r"\{.*\}", "schema": schema}] * 4
    per_fn, total = Rewards(["exact_match", "regex_format", "json_schema", "python_syntax"],
                            [1.0, 0.5, 2.0, 0.25], tokenizer)(["p"] * 4, comps, ids, rows)
    assert per_fn.tolist() == [[0, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 1]]
    assert total.tolist() == [2.75, 0.75, 0.0, 1.25]


def none_for_odd(prompts, completions, **kw):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def fails_on_second(prompts, completions, **kw):
    if any(c == "boom" for c in completions):
        raise ValueError("cannot score")
    return [0.0] * len(completions)


def test_none_is_left_out_and_errors_name_the_function_and_row():
    per_fn, total = Rewards([none_for_odd])(["p", "q"], ["a", "b"], [[1], [2]], [{}, {}])
    assert total[0] == 1.0 and math.isnan(total[1]) and math.isnan(per_fn[1, 0])
    with pytest.raises(BrrrError, match=r"fails_on_second raised ValueError: cannot score .*completion 1 \(prompt "
                                        r"row at line 7\).*'boom'"):
        Rewards([fails_on_second])(["p", "q"], ["ok", "boom"], [[1], [2]], [{}, {}], lines=[3, 7])
    with pytest.raises(BrrrError, match="returned 1 values for 2"):
        Rewards([lambda prompts, completions, **kw: [1.0]])(["p", "q"], ["a", "b"], [[1], [2]], [{}, {}])
    with pytest.raises(BrrrError, match="MODULE:FUNCTION"):
        load_reward("nonsense")
    with pytest.raises(BrrrError, match="no function nope"):
        load_reward("tests.train.test_rewards:nope")
    assert load_reward("tests.train.test_rewards:none_for_odd") is none_for_odd
    with pytest.raises(BrrrError, match='"answer" field'):
        Rewards(["exact_match"])(["p"], ["a"], [[1]], [{"other": 1}])
    assert torch.equal(Rewards(["python_syntax"])(["p"], ["1 +"], [[1]], [{}])[1], torch.tensor([0.0]))


def test_chat_completions_arrive_as_messages_the_builtins_read():
    chat = [[{"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "x = ("}]]
    per_fn, _ = Rewards(["python_syntax", "exact_match"])(["p", "q"], chat, [[1], [2]], [{"answer": "42"}] * 2)
    assert per_fn.tolist() == [[1, 1], [0, 0]]
