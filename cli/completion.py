"""`kvwatch completion bash|zsh`: a shell completion script built from kvwatch's own argparse parser, so
that it completes exactly the commands, options and choices of the kvwatch that printed it."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Iterator

SHELLS = ("bash", "zsh")

# Tables keyed by command path ("kvwatch lab up") and, for an option's values, path and option
# ("kvwatch lab up --engine"): words are subcommands and positional choices; an option's values are its
# choices, or empty for a file name.
FUNCTION = """
_kvwatch() {
    [[ -n ${ZSH_VERSION-} ]] && emulate -L ksh  # bash's 0-based COMP_WORDS
    local path=kvwatch key i cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    for ((i = 1; i < COMP_CWORD; i++)); do
        key="$path ${COMP_WORDS[i]}"
        [[ -n ${_kvwatch_options[$key]+set} ]] && path=$key
    done
    key="$path $prev"
    if [[ -n ${_kvwatch_values[$key]+set} ]]; then
        if [[ -n ${_kvwatch_values[$key]} ]]; then
            COMPREPLY=($(compgen -W "${_kvwatch_values[$key]}" -- "$cur"))
        else
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
    elif [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "${_kvwatch_options[$path]}" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "${_kvwatch_words[$path]}" -- "$cur"))
    fi
}
complete -F _kvwatch kvwatch
"""
PREAMBLES = {
    "bash": '# kvwatch completion for bash: eval "$(kvwatch completion bash)" in ~/.bashrc\n',
    "zsh": '# kvwatch completion for zsh: eval "$(kvwatch completion zsh)" in ~/.zshrc\n'
    "(( $+functions[compdef] )) || { autoload -U +X compinit && compinit; }\n"
    "autoload -U +X bashcompinit && bashcompinit\n",
}


def command_tree(
    parser: argparse.ArgumentParser, path: str = "kvwatch"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command's path and parser, the top-level one first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from command_tree(sub, f"{path} {name}")


def _table(name: str, entries: dict[str, str]) -> str:
    rows = "".join(f"    [{shlex.quote(key)}]={shlex.quote(value)}\n" for key, value in entries.items())
    return f"typeset -gA {name}=(\n{rows})\n"


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for `shell`: the parser's tables and the function that reads them."""
    words, options, values = {}, {}, {}
    for path, command in command_tree(parser):
        shown = [a for a in command._actions if a.help != argparse.SUPPRESS]
        words[path] = " ".join(
            str(choice)
            for action in shown
            if not action.option_strings and action.choices
            for choice in action.choices
        )
        options[path] = " ".join(flag for action in shown for flag in action.option_strings)
        for action in shown:
            if action.option_strings and action.nargs != 0:
                for flag in action.option_strings:
                    values[f"{path} {flag}"] = " ".join(map(str, action.choices or ()))
    tables = _table("_kvwatch_words", words) + _table("_kvwatch_options", options)
    return PREAMBLES[shell] + tables + _table("_kvwatch_values", values) + FUNCTION


def add_parser(
    subparsers: argparse._SubParsersAction, full_parser: Callable[[], argparse.ArgumentParser]
) -> None:
    completion = subparsers.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for kvwatch's commands, options and choices; e.g. add "
        'eval "$(kvwatch completion bash)" to ~/.bashrc.',
    )
    completion.add_argument("shell", choices=SHELLS, help="the shell to complete in")

    def run(args: argparse.Namespace) -> int:
        print(script(full_parser(), args.shell), end="")
        return 0

    completion.set_defaults(handler=run)
