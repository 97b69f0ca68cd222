"""``python -m fairseq_hrt.options_help train|generate|interactive ARGS...``: fairseq's ``--help``
with every option that ARGS select (the task's, the model's, the criterion's).

fairseq 0.12 parses a command line twice: first to learn the task, ``--arch`` and
``--criterion``, then again after they have added their options. ``--help`` acts on the first
parse, so ``fairseq-generate DATA --user-dir fairseq_hrt --task hrt_translation --help`` lists
none of the task's options (``--decoding``, ``--decoder-engine``, ``--decode-chunk-size``, ...).
This command does both parses as fairseq does, then prints the help of the full parser. It is
the plugin's own command; fairseq's ``--help`` is unchanged.

    python -m fairseq_hrt.options_help generate DATA --user-dir fairseq_hrt --task hrt_translation
"""

import sys

from fairseq import options

PARSERS = {
    "train": options.get_training_parser,
    "generate": options.get_generation_parser,
    "interactive": options.get_interactive_generation_parser,
}
HELP_FLAGS = ("-h", "--help")
# fills the task's DATA positional when ARGS give none (a second positional is ignored)
DATA_PLACEHOLDER = ("--", "DATA")


def full_help(command: str, args) -> str:
    """The help of fairseq-COMMAND's parser once ``args`` (without ``--help``) have added their
    task's, model's and criterion's options."""
    parser = PARSERS[command]()
    given = [a for a in map(str, args) if a not in HELP_FLAGS]
    options.parse_args_and_arch(parser, [*given, *DATA_PLACEHOLDER], parse_known=True)
    parser.prog = f"fairseq-{command}"
    return parser.format_help()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in PARSERS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(full_help(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
