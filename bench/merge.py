#!/usr/bin/python3
"""bench/merge.py ROWS BASE_RES BASE_EXTRA RUN_RES RUN_EXTRA OUT_RES OUT_EXTRA:
the numbers of a partial bench/run (ROWS=15-18 ...) merged into those of the
last run, for bench/report.py.

results: the last run's lines of rows outside ROWS, then every line of this
run (a line's row is a number or a range such as 1-7; it is replaced when
any of its rows is in ROWS).
extra: the last run's keys, overwritten by this run's, except
  - what describes the whole run (date, machine, settings, parameters, build,
    behavioural checks): the last run's stays, and this run's goes to
    run.N for each row N in ROWS, which the report prints;
  - sizes of particular rows (n_replay ...): overwritten only when one of
    their rows is in ROWS;
  - verification warnings of the labels this run measured again: dropped;
  - a profile (sqlprof_NAME and its sqlprof_NAME.FUNCTION keys) this run
    took again: the last run's dropped whole, so that a function this run
    no longer calls does not linger in it.
A missing BASE file counts as an empty last run."""
import os
import sys

GENERAL = ("date", "pg_version", "nproc", "cpu", "settings", "params", "have_ext",
           "have_worker", "so", "check_peer", "check_ext")
SIZE_ROWS = {"n_replay": {8, 14, 20}, "n_small": {12}, "n_big": {12}, "n_big_actual": {12},
             "n_sweep": {11}, "n_backlog": {11}, "batch": {15, 22, 23}, "n_ckpt": {16},
             "n_prof": {19, 20}}


def parse_rows(spec):
    rows = set()
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            rows.update(range(int(a), int(b) + 1))
        elif part:
            rows.add(int(part))
    return rows


def lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def main():
    spec, base_res, base_extra, run_res, run_extra, out_res, out_extra = sys.argv[1:8]
    wanted = parse_rows(spec)
    run_lines = lines(run_res)
    labels = {line.split("\t")[0] for line in run_lines}
    with open(out_res, "w") as f:
        for line in lines(base_res):
            row = line.split("\t")[1]
            if not parse_rows(row) & wanted:
                f.write(line + "\n")
        for line in run_lines:
            f.write(line + "\n")

    extra = {}
    for line in lines(base_extra):
        k, _, v = line.partition("\t")
        if k.startswith("verify_failed_") and any(
                k[14:] == lb or k[14:].startswith(lb + "_") for lb in labels):
            continue
        extra[k] = v
    profiles = {line.partition("\t")[0] for line in lines(run_extra)
                if line.startswith("sqlprof_") and "." not in line.partition("\t")[0]}
    for k in [k for k in extra if k.partition(".")[0] in profiles]:
        del extra[k]
    general = {}
    for line in lines(run_extra):
        k, _, v = line.partition("\t")
        if k in GENERAL:
            general[k] = v
            extra.setdefault(k, v)
        elif k in SIZE_ROWS and k in extra and not SIZE_ROWS[k] & wanted:
            continue
        else:
            extra[k] = v
    note = "%s, `%s`, build %s" % (general.get("date", "?"), general.get("params", "?"),
                                   general.get("so", "?"))
    if general.get("check_ext", "passed") != "passed":
        note += "; behavioural checks of the extension: " + general["check_ext"]
    for n in sorted(wanted):
        extra["run.%d" % n] = note
    with open(out_extra, "w") as f:
        for k, v in extra.items():
            f.write("%s\t%s\n" % (k, v))


if __name__ == "__main__":
    main()
