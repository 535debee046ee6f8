"""commit-msg hook (.pre-commit-config.yaml): a subject line of at most 72 characters, then a blank
line before the body that gives the reason. Usage: python .ci/commit_subject.py MESSAGE_FILE"""

import sys
from pathlib import Path

MAX_SUBJECT = 72


def problems(message: str) -> list[str]:
    lines = [line for line in message.splitlines() if not line.startswith("#")]  # git's comment lines
    if not lines or not lines[0].strip():
        return ["the subject line is empty"]
    out = []
    if len(lines[0]) > MAX_SUBJECT:
        out.append(f"the subject is {len(lines[0])} characters; at most {MAX_SUBJECT} (the reason goes in the body)")
    if len(lines) > 1 and lines[1].strip():
        out.append("leave a blank line between the subject and the body")
    return out


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]).read_text(encoding="utf-8"))
    for p in found:
        print(f"commit message: {p}", file=sys.stderr)
    sys.exit(1 if found else 0)
