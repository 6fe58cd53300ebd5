"""Copies a GPU check's summary (OUT_DIR/results.md from bench/gpu_check.sh)
into bench/RESULTS.md, between markers that run_bench.py keeps.

  python bench/record_gpu_results.py OUT_DIR
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN = "<!-- gpu check: begin (bench/gpu_check.sh, bench/record_gpu_results.py) -->"
END = "<!-- gpu check: end -->"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    summary_path = os.path.join(sys.argv[1], "results.md")
    if not os.path.exists(summary_path):
        sys.exit(f"{summary_path} does not exist: run bench/gpu_check.sh {sys.argv[1]} on the GPU machine first")
    summary = open(summary_path).read().strip("\n")
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
