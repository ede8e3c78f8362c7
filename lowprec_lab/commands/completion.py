"""Shell completion for the ``lowprec`` command (bash; zsh through ``bashcompinit``).

``lowprec --shell-completion install=bash`` (or ``-sc``) prints a script that registers ``lowprec``, the command
that exists (Hydra's own flag after ``train`` registered ``lowprec-train``, which does not). On a TAB, the script
runs ``lowprec -sc query=bash`` with bash's ``COMP_LINE``: the first word completes to a subcommand; after
``train`` or ``ablate`` Hydra's own completion answers (config groups, keys, values); after ``estimate`` or
``recommend``, ``PLANNING_KEYS`` (static, so a TAB imports neither Hydra nor torch; a test keeps it equal to their
schemas in ``lowprec_lab.plan.estimate_config``); after another subcommand, the keys and flags its lines of the
usage text name.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

COMPLETION_FLAGS = ("-sc", "--shell-completion")
SHELLS = ("bash",)

_SCRIPT = """_lowprec_completion()
{
    local choices
    choices=$(COMP_POINT=$COMP_POINT COMP_LINE=$COMP_LINE "${COMP_WORDS[0]}" -sc query=bash 2>/dev/null)
    if [ "$COMP_CWORD" -le 1 ]; then
        compopt +o nospace 2>/dev/null  # a subcommand is a whole word
    fi
    COMPREPLY=($(compgen -o nospace -o default -W "$choices" -- "${COMP_WORDS[COMP_CWORD]}"))
}
COMP_WORDBREAKS=${COMP_WORDBREAKS//=}
complete -o nospace -o default -F _lowprec_completion lowprec
"""
_UNINSTALL = "complete -r lowprec 2>/dev/null\nunset -f _lowprec_completion\n"

#: The keys of ``lowprec estimate`` and ``lowprec recommend`` a TAB offers: the ``lowprec train`` keys they read and
#: their own (``EstimateConfig``, ``RecommendConfig``; every other key of train composes too), and their flags.
_SHARED = (
    "model=",
    "train.batch_size=",
    "train.seq_len=",
    "train.ac=",
    "train.compile=",
    "parallel.dp_shard=",
    "parallel.tp=",
)
PLANNING_KEYS = {
    "estimate": (
        *_SHARED,
        "recipe=",
        "hardware=",
        "efficiency=",
        "async_tp=",
        "--emulate",
        "--json",
        "--validate",
    ),
    "recommend": (
        *_SHARED,
        "hardware=",
        "gpus=",
        "tokens=",
        "max_loss_gap=",
        "recipes=",
        "ablate_steps=",
        "tracking.uri=",
        "--json",
    ),
}


def subcommands(usage: str) -> list[str]:
    """The subcommands the usage text's first line lists (``usage: lowprec {train,ablate,...} ...``)."""
    return re.search(r"\{([\w,]+)\}", usage).group(1).split(",")


def options(usage: str, cmd: str) -> list[str]:
    """The ``key=`` and ``--flag`` words of ``cmd``'s lines in the usage text (the line that starts with
    ``lowprec <cmd>`` and the indented lines that continue it), in order, once each."""
    words: list[str] = []
    mine = False
    for line in usage.splitlines():
        head = line.strip()
        if head.startswith("lowprec "):
            mine = head.split()[1] == cmd
        elif not line.startswith("    "):
            mine = False
        if mine:
            words += re.findall(r"(?<![\w.-])(--[\w-]+|[a-z][\w.]*=)(?!value\b)", head)
    return list(dict.fromkeys(words))


def query(line: str, usage: str, hydra_main: Callable[[str, Callable, list[str]], int]) -> list[str] | None:
    """The completions of ``line`` (bash's ``COMP_LINE``: ``lowprec ...``); None where Hydra printed them."""
    words = line.split()
    current = 0 if line.endswith(" ") else 1  # the word under the cursor is still being typed
    if len(words) - current <= 1:
        return [*subcommands(usage), "--help", "--version"]
    cmd = words[1]
    if cmd in ("train", "ablate"):
        # Hydra's completion of the line without `lowprec` (it strips the app name itself: here `train`)
        os.environ["COMP_LINE"] = line.split(None, 1)[1]
        hydra_main(cmd, lambda cfg: None, ["-sc", "query=bash"])
        return None
    if cmd in PLANNING_KEYS:
        return list(PLANNING_KEYS[cmd])
    return options(usage, cmd)


def completion_main(argv: list[str], usage: str, hydra_main: Callable[[str, Callable, list[str]], int]) -> int:
    """``install=bash``, ``uninstall=bash`` or ``query=bash`` (with ``COMP_LINE`` set); exit status 2 for anything
    else, with one line on stderr."""
    action, _, shell = (argv[0] if argv else "").partition("=")
    if action not in ("install", "uninstall", "query") or shell not in SHELLS:
        print(
            f"lowprec --shell-completion: expected install=SHELL, uninstall=SHELL or query=SHELL with SHELL one of "
            f"{', '.join(SHELLS)} (zsh: autoload bashcompinit && bashcompinit, then install=bash); got {argv}",
            file=sys.stderr,
        )
        return 2
    if action == "install":
        print(_SCRIPT, end="")
    elif action == "uninstall":
        print(_UNINSTALL, end="")
    else:
        found = query(os.environ.get("COMP_LINE", "lowprec "), usage, hydra_main)
        if found is not None:
            print(" ".join(found))
    return 0
