"""Copies a GPU check's summary (OUT_DIR/results.md from bench/gpu_check.sh)
into bench/RESULTS.md, between markers that run_bench.py keeps.

  python3 bench/record_gpu_results.py OUT_DIR [--allow-cpu] [--allow-partial]

OUT_DIR is what bench/gpu_check.sh wrote (with --compact: results.md,
results.json, stages.tsv, env.txt, logs.tar.gz), e.g. the folder a device
run's files came back to. A CPU dry run (--cpu) is refused unless
--allow-cpu; a run cut short is refused unless --allow-partial. Needs only
the standard library (any python3).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN = "<!-- gpu check: begin (bench/gpu_check.sh, bench/record_gpu_results.py) -->"
END = "<!-- gpu check: end -->"


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    if len(args) != 1 or flags - {"--allow-cpu", "--allow-partial"}:
        sys.exit(__doc__)
    summary_path = os.path.join(args[0], "results.md")
    if not os.path.exists(summary_path):
        sys.exit(f"{summary_path} does not exist: run bench/gpu_check.sh {args[0]} on the GPU machine first")
    summary = open(summary_path).read().strip("\n")
    first = summary.splitlines()[0] if summary else ""
    if "CPU dry run" in first and "--allow-cpu" not in flags:
        sys.exit(f"{summary_path} is a CPU dry run (gpu_check.sh --cpu), not GPU figures; --allow-cpu records it anyway")
    if "Run: complete." not in summary and "--allow-partial" not in flags:
        sys.exit(f"{summary_path} is from a run that did not finish (see its 'Run:' line and stages); "
                 "--allow-partial records it anyway")
    # One level down: the summary's headings become subsections of RESULTS.md.
    summary = "\n".join("#" + line if line.startswith("#") else line for line in summary.splitlines())
    section = f"{BEGIN}\n{summary}\n{END}"
    path = os.path.join(HERE, "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN.split(" (")[0] in text and END in text:
        start = text.index(BEGIN.split(" (")[0])
        text = text[:start] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(f"recorded {summary_path} in {path}")


if __name__ == "__main__":
    main()
