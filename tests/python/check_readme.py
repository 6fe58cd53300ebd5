"""Keeps the README's tutorial (and docs/big_models.md's) honest.

usage: check_readme.py README.md SOURCE_DIR BUILD_DIR

In the "## Tutorial" section of README.md:
  - every ```cpp block must appear, line for line (indentation aside), in a
    source file under examples/ that the build compiles;
  - every ```sh block is run with bash from SOURCE_DIR, "build/bin/" pointing
    at BUILD_DIR/bin and $PYTHON at the torch this check runs under, and must
    exit 0 within 5 minutes;
  - any other kind of block is an error, so nothing escapes unchecked.
"""
import glob
import os
import re
import subprocess
import sys


def tutorial_blocks(readme):
    text = open(readme).read()
    start = text.index("## Tutorial")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    return re.findall(r"^```(\w*)\n(.*?)^```", section, flags=re.M | re.S)


def normalized(lines):
    return [line.strip() for line in lines if line.strip()]


def main():
    readme, source_dir, build_dir = sys.argv[1:4]
    sources = {}
    for pattern in ("*.cpp", "*.h"):
        for path in glob.glob(os.path.join(source_dir, "examples", "**", pattern), recursive=True):
            sources[path] = normalized(open(path).read().splitlines())

    passed, failed = 0, 0
    blocks = tutorial_blocks(readme)
    for number, (kind, body) in enumerate(blocks, 1):
        label = f"block {number} ({kind or 'no language'})"
        if kind == "cpp":
            wanted = normalized(body.splitlines())
            found = any(
                lines[i:i + len(wanted)] == wanted for lines in sources.values() for i in range(len(lines) - len(wanted) + 1))
            if found:
                passed += 1
            else:
                failed += 1
                print(f"FAILED {label}: not found verbatim in examples/: {wanted[0]!r}")
        elif kind == "sh":
            script = body.replace("build/bin/", os.path.join(os.path.abspath(build_dir), "bin") + "/")
            try:
                run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=source_dir, capture_output=True,
                                     text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable,
                                                                # CI runs as root; mpirun refuses root unless told.
                                                                OMPI_ALLOW_RUN_AS_ROOT="1",
                                                                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
                ok = run.returncode == 0
                detail = run.stdout[-2000:] + run.stderr[-2000:]
            except subprocess.TimeoutExpired:
                ok, detail = False, "timed out after 300 s"
            if ok:
                passed += 1
            else:
                failed += 1
                print(f"FAILED {label}: exit {run.returncode}\n{script}\n{detail}")
        else:
            failed += 1
            print(f"FAILED {label}: use cpp (checked against the sources) or sh (run)")
    if passed + failed < 5:
        failed += 1
        print(f"FAILED: only {passed + failed - 1} checkable blocks found; is the Tutorial section there?")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
