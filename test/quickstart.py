#!/usr/bin/python3
"""test/quickstart.py: the README's quick starts, run as written.

Usage (as root, from the root of a copy of the tree):
    test/quickstart.py [--demo-port N] [--app-port N]

It runs `./run demo --keep` (which prints the env.sh that the README tells
the reader to source), then every fenced block of README.md whose info
string carries the word `quickstart`, in order:

- `<lang> quickstart file=PATH`: the block is written to PATH (relative to
  the tree);
- `sh quickstart`: the block runs with bash -e from the tree's root, with the
  demo's libpq variables; a ```text output``` block right after it lists
  lines that must appear in its output, in that order (case-insensitive
  substrings; header names are case-insensitive in HTTP);
- `sh quickstart background ready=WORD`: the block is started and left
  running; the next block runs once WORD appears in its output.

At the end the background processes are stopped (by process group) and the
demo cluster with the stop script the demo printed.  Prints TAP and exits
non-zero on a failure.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\S*)(.*)$")


def blocks(text):
    """Yield (lang, attrs, body) for each fenced block of the markdown text."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, words = m.group(1), m.group(2).split()
        body = []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        i += 1
        attrs = {}
        for w in words:
            key, _, value = w.partition("=")
            attrs[key] = value if value else True
        yield lang, attrs, "\n".join(body) + "\n"


class Tap:
    def __init__(self):
        self.n = 0
        self.failed = 0

    def ok(self, good, what, detail=""):
        self.n += 1
        print(("ok" if good else "not ok") + f" {self.n} - {what}", flush=True)
        if not good:
            self.failed += 1
            for line in detail.rstrip().split("\n")[-40:]:
                print("#   " + line)


def lines_in_order(expected, output):
    """Whether each non-empty expected line is a substring of a later output line."""
    out = [l.lower() for l in output.split("\n")]
    pos = 0
    for want in (l.strip().lower() for l in expected.split("\n")):
        if not want:
            continue
        while pos < len(out) and want not in out[pos]:
            pos += 1
        if pos == len(out):
            return want
        pos += 1
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo-port", type=int, default=55419)
    ap.add_argument("--app-port", type=int, default=55420)
    args = ap.parse_args()
    tap = Tap()
    env = dict(os.environ, IDEM_DEMO_PORT=str(args.demo_port), PORT=str(args.app_port))
    demo = subprocess.run(["./run", "demo", "--keep"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m = re.search(r"^\s*\. (\S+/env\.sh)$", demo.stdout, re.M)
    stop = re.search(r"^\s*(\S+/stop)$", demo.stdout, re.M)
    tap.ok(demo.returncode == 0 and m is not None and stop is not None,
           "./run demo --keep runs and prints its env.sh and stop script", demo.stdout)
    if not m or not stop:
        print(f"1..{tap.n}")
        return 1
    url = re.search(r"^\s*psql (postgresql://\S+)$", demo.stdout, re.M)
    printed = re.search(r"^\s*(export PGHOST=\S+ PGPORT=\d+ PGUSER=postgres PGDATABASE=shop)$",
                        demo.stdout, re.M)
    tap.ok(printed is not None and printed.group(1) + "\n" in open(m.group(1)).read(),
           "it prints the libpq exports, the same as its env.sh holds", demo.stdout)
    for line in open(m.group(1)):
        kv = re.match(r"^export (.*)$", line.strip())
        if kv:
            for pair in kv.group(1).split():
                key, _, value = pair.partition("=")
                env[key] = value.strip("'")
    check = subprocess.run(["psql", "-XAtc", "SELECT extversion FROM pg_extension"
                            " WHERE extname = 'idempotency'", url.group(1) if url else ""],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tap.ok(check.returncode == 0 and check.stdout.strip() != "",
           "the printed URL reaches the database shop, which has the extension", check.stdout)
    background = []
    try:
        text = open(os.path.join(ROOT, "README.md")).read()
        last = None
        for number, (lang, attrs, body) in enumerate(blocks(text), 1):
            if lang == "text" and attrs.get("output") and last is not None:
                what, output = last
                missing = lines_in_order(body, output)
                tap.ok(missing is None, f"its output shows what the README says ({what})",
                       f"missing: {missing}\n--- output:\n{output}")
                last = None
                continue
            if not attrs.get("quickstart"):
                continue
            first = f"README block {number}: " + body.strip().split("\n")[0]
            if "file" in attrs:
                path = os.path.join(ROOT, attrs["file"])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(body)
                last = None
                continue
            if attrs.get("background"):
                log = open(os.path.join(ROOT, f".quickstart-{len(background)}.log"), "w+")
                proc = subprocess.Popen(["bash", "-ec", body], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                background.append((proc, log))
                word = attrs.get("ready", "")
                deadline = time.monotonic() + 120
                seen = ""
                while proc.poll() is None and time.monotonic() < deadline:
                    log.seek(0)
                    seen = log.read()
                    if word in seen:
                        break
                    time.sleep(0.1)
                tap.ok(word in seen, f"started and ready: {first}", seen)
                last = None
                continue
            run = subprocess.run(["bash", "-ec", body], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
            tap.ok(run.returncode == 0, f"runs: {first}", run.stdout)
            last = (first, run.stdout)
    finally:
        for proc, log in background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            log.close()
        done = subprocess.run([stop.group(1)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        tap.ok(done.returncode == 0, "the stop script stops the demo cluster", done.stdout)
    print(f"1..{tap.n}")
    return 1 if tap.failed else 0


if __name__ == "__main__":
    sys.exit(main())
