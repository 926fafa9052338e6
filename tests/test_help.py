"""`brrr ... --help` says each option's default once: argparse's "(default: X)" beside a help text that states its
own default printed it twice ("(default: brrr's shipped model) (default: None)")."""
import argparse
import subprocess
import sys

from brrr.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "brrr"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_states_its_default_once():
    parsers = dict(_parsers(build_parser()))
    assert {"brrr serve", "brrr train", "brrr finetune", "brrr bench serve", "brrr calc roofline"} <= parsers.keys()
    twice = []
    for name, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help and action.help is not argparse.SUPPRESS:
                text = formatter._expand_help(action)
                if text.count("(default") > 1 or "(default: None)" in text:
                    twice.append(f"{name} {'/'.join(action.option_strings) or action.dest}: {text}")
    assert not twice, "\n".join(twice)
    # the formatter still adds the defaults no help text states
    (seq_len,) = [a for a in parsers["brrr train"]._actions if "--seq-len" in a.option_strings]
    assert parsers["brrr train"]._get_formatter()._expand_help(seq_len).endswith("(default: 1024)")


def test_the_cli_builds_without_triton():
    """A CPU install (torch's CPU wheel pulls no Triton) runs every command: no module imports a Triton-only name."""
    code = ("import sys; sys.modules['triton'] = sys.modules['triton.language'] = None\n"
            "from brrr.cli import build_parser; build_parser(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
