"""The brrr command line, as the tests drive it."""
from brrr.cli import main


def refuses(capsys, argv: list[str], message: str) -> None:
    """`brrr ARGV` exits with status 2 and says `message` on stderr (a clear error, no traceback)."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err
