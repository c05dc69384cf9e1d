"""``python -m epx_tools.plot RESULTS.json [MORE.json ...] [--out DIR]``: plots of benchmark results.

Reads the JSON lines that ``epx-bench --json-file F`` (C++) and ``python -m epx_tools.bench --json-file F`` write,
one object per measured op::

    {"mode":"normal","op":"dispatch BF16","num_sms":24,"num_ranks":1,"mean_us":97.34,"slowest_us":97.34,
     "gbps_mean":603.22,"gbps_min":603.22}

(mode ``normal`` or ``low-latency``; mean over ranks and slowest rank; GB/s mean over ranks and of the slowest
rank), and draws PNG and SVG files into ``--out``:

- ``normal-sms[-t<T>]``: normal-mode GB/s against the SM budget, one line per op (dispatch BF16, dispatch FP8,
  cached dispatch, combine BF16), the NCCL all-to-all baseline of the same run as horizontal lines; one figure
  per token count.
- ``low-latency[-t<T>]``: low-latency GB/s and microseconds per op (these kernels take no SM budget), NCCL
  beside EPX; one figure per token count.
- ``normal-tokens`` (two token counts or more): normal-mode GB/s against tokens per rank, one line per op and
  SM budget, NCCL as dashed lines.
- ``low-latency-tokens`` (two token counts or more): low-latency GB/s and latency (microseconds) against
  tokens per rank.

Several files, or several runs concatenated in one file (a run ends where an op comes again), give several
token counts. The JSON lines carry no token count, so each run takes it from, in order: a ``num_tokens`` /
``tokens`` field or a header ("... 4096 tokens/rank ...") in the JSON when there is one, ``--tokens`` (one
count per run, in the order of the files), or the file name when it holds one number (``bench-4096.json``,
``run-t16384.json``). A file name's number goes to the normal-mode rows, or to the low-latency rows of a file
without normal-mode rows; ``--ll-tokens`` gives low-latency counts explicitly.

Rows that cannot be plotted are listed, not drawn: breakdown rows without bytes ("  of which notify"), the
copy-engine row (a link ceiling, not an all-to-all), the CPU reference run's JSON and lines that are not JSON.
``--list`` prints the figures' series without drawing.

Only the standard library is needed to read the JSON; matplotlib (Agg canvas, no pyplot) is imported only to
draw. It needs nothing from epx, so it runs on a machine that has only the JSON and python/ on PYTHONPATH
(``python path/to/epx_tools/plot.py results.json`` works too). The bar chart of one run, EPX beside NCCL, is
``python -m epx_tools.bench_plot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

PROG = "python -m epx_tools.plot"
NORMAL = "normal"
LOW_LATENCY = "low-latency"
# The byte counts behind GB/s (epx-bench --help, docs/BENCHMARKS.md), for figures whose JSON has no header saying it.
BYTES_DEFINITION = {
    NORMAL: "GB/s = bytes a rank receives / time: rows received x (2H BF16 | H + 4H/128 FP8); combine counted as "
            "BF16 dispatch",
    LOW_LATENCY: "GB/s = bytes a rank receives / time: valid (token, expert) selections x (H + H/32 + 16 FP8 | "
                 "2H BF16 | 1.25H + H/32 LogFMT)",
}
FORMATS = ("png", "svg")


class PlotError(Exception):
    """A problem with the inputs or the options: the CLI prints it on one line and exits with 2."""


# ---- Reading the JSON ----


@dataclass
class Row:
    """One plottable row: an op of one run, averaged over ranks as the bench reports it."""

    source: str  # "file:line"
    mode: str  # NORMAL or LOW_LATENCY
    op: str
    num_sms: int  # 0: not an SM-budgeted kernel (NCCL, low-latency)
    num_ranks: int
    mean_us: float
    slowest_us: float
    gbps_mean: float
    gbps_min: float
    run: int  # index of the run (one epx-bench invocation) over all inputs
    tokens: Optional[int] = None  # tokens per rank
    header: str = ""
    file: str = ""  # the input it came from

    @property
    def baseline(self) -> bool:
        """True for the NCCL all-to-all rows the bench runs beside EPX."""
        return self.op.startswith("NCCL")

    def value(self, what: str, stat: str) -> float:
        """what: "gbps" or "us"; stat: "mean" (mean over ranks) or "min" (slowest rank)."""
        if what == "gbps":
            return self.gbps_mean if stat == "mean" else self.gbps_min
        return self.mean_us if stat == "mean" else self.slowest_us


@dataclass
class Skipped:
    source: str
    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.what}: {self.reason}" if self.what else f"{self.source}: {self.reason}"


@dataclass
class Results:
    rows: List[Row] = field(default_factory=list)
    skipped: List[Skipped] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # how token counts were found, merged duplicates, ...
    sources: List[str] = field(default_factory=list)
    machine: str = ""  # a "machine" / "device" / "gpu_name" string in the JSON, or --machine


_TOKENS_IN_HEADER = re.compile(r"(\d+) tokens?/rank")
# A number standing alone in a file name (bench-4096.json, run_t16384.json), not part of a word (h200, 8gpus).
_NUMBER_IN_NAME = re.compile(r"(?:^|[^A-Za-z0-9])(?:[Tt]|tokens)?(\d+)(?=$|[^A-Za-z0-9])")


def _mode(value: Any) -> str:
    text = str(value or "").strip().lower().replace("_", "-")
    if text in ("ll", "low-latency", "lowlatency"):
        return LOW_LATENCY
    return text


def _number(value: Any) -> Optional[float]:
    """A finite float, or the mean of a list of them (per-rank values); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (list, tuple)):
        values = [_number(v) for v in value]
        if not values or any(v is None for v in values):
            return None
        return sum(values) / len(values)  # type: ignore[arg-type]
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _per_rank(value: Any) -> Optional[List[float]]:
    if isinstance(value, (list, tuple)):
        values = [_number(v) for v in value]
        return None if not values or any(v is None for v in values) else values  # type: ignore[return-value]
    number = _number(value)
    return None if number is None else [number]


def _tokens_of(obj: Dict[str, Any], mode: str) -> Optional[int]:
    keys = ("ll_num_tokens", "ll_tokens", "num_tokens", "tokens") if mode == LOW_LATENCY else ("num_tokens", "tokens")
    for key in keys:
        value = obj.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    match = _TOKENS_IN_HEADER.search(str(obj.get("header", "")))
    return int(match.group(1)) if match else None


def _records(text: str, name: str) -> Iterable[Tuple[str, Any]]:
    """(source, JSON value) for every record: JSON lines, or one JSON document (an object or a list)."""
    stripped = text.strip()
    if not stripped:
        return []
    if "\n" in stripped:
        try:
            whole = json.loads(stripped)
        except ValueError:
            whole = None
        if isinstance(whole, list):
            return [(f"{name}[{i}]", item) for i, item in enumerate(whole)]
        if isinstance(whole, dict):
            return [(name, whole)]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{name}:{number}", json.loads(line)))
        except ValueError:
            out.append((f"{name}:{number}", _NotJson(line.strip())))
    return out


class _NotJson(str):
    pass


def _row(source: str, obj: Dict[str, Any], table: Dict[str, Any], headers: Dict[str, str],
         skipped: List[Skipped]) -> Optional[Row]:
    """A Row from one JSON object (table: the fields of an enclosing table object, if any), or None with the
    reason appended to skipped."""
    op = str(obj.get("op", ""))
    mode = _mode(obj.get("mode", table.get("mode", "")))
    label = op.strip() or "(no op)"
    if mode not in (NORMAL, LOW_LATENCY):
        skipped.append(Skipped(source, label, f"mode {mode or '(none)'!r} is neither normal nor low-latency"))
        return None
    if op.strip().lower().startswith("copy engine"):
        skipped.append(Skipped(source, label, "copy-engine row (a link ceiling, not an all-to-all)"))
        return None
    times = None
    for key in ("mean_us", "time_us", "times_us"):
        if key in obj:
            times = _per_rank(obj[key])
            break
    if times is None or not all(t > 0 for t in times):
        skipped.append(Skipped(source, label, "no positive time"))
        return None
    mean_us = sum(times) / len(times)
    slowest_us = _number(obj.get("slowest_us"))
    slowest_us = max(times) if slowest_us is None else slowest_us
    gbps_mean, gbps_min = _number(obj.get("gbps_mean")), _number(obj.get("gbps_min"))
    if gbps_mean is None:  # per-rank bytes and times: GB/s per rank, as bench_report.cpp computes it
        nbytes = _per_rank(obj.get("bytes", obj.get("bytes_per_rank")))
        if nbytes is not None and len(nbytes) in (1, len(times)):
            nbytes = nbytes * len(times) if len(nbytes) == 1 else nbytes
            rates = [b / (t * 1e3) for b, t in zip(nbytes, times)]
            gbps_mean, gbps_min = sum(rates) / len(rates), min(rates)
    if gbps_mean is None or gbps_mean <= 0:
        skipped.append(Skipped(source, label, "no bytes counted (it breaks another row's time down)"))
        return None
    header = str(obj.get("header") or table.get("header") or headers.get(mode, ""))
    tokens = _tokens_of(obj, mode) or _tokens_of(table, mode) or _tokens_of({"header": header}, mode)
    sms = _number(obj.get("num_sms"))
    ranks = _number(obj.get("num_ranks", table.get("num_ranks")))
    return Row(source=source, mode=mode, op=op.strip(), num_sms=int(sms or 0),
               num_ranks=int(ranks) if ranks else len(times), mean_us=mean_us, slowest_us=slowest_us,
               gbps_mean=gbps_mean, gbps_min=gbps_min if gbps_min is not None else gbps_mean, run=-1,
               tokens=tokens, header=header)


def _file_rows(text: str, name: str, results: Results) -> List[Row]:
    rows: List[Row] = []
    headers: Dict[str, str] = {}  # mode -> the latest header line (a header-only JSON object) of that mode
    for source, obj in _records(text, name):
        if isinstance(obj, _NotJson):
            shown = obj if len(obj) <= 40 else obj[:37] + "..."
            results.skipped.append(Skipped(source, "", f"not JSON ({shown!r})"))
            continue
        if not isinstance(obj, dict):
            results.skipped.append(Skipped(source, "", "a JSON value that is not an object"))
            continue
        for key in ("machine", "device", "gpu_name"):
            if isinstance(obj.get(key), str) and obj[key] and not results.machine:
                results.machine = obj[key]
        if _mode(obj.get("mode")) == "cpu-reference" or "results" in obj:
            results.skipped.append(Skipped(source, "CPU reference run", "CPU times of the reference, no GPU "
                                           "numbers to plot"))
            continue
        if isinstance(obj.get("rows"), list):  # a table: its own fields, then its rows
            table = {k: v for k, v in obj.items() if k != "rows"}
            for i, item in enumerate(obj["rows"]):
                where = f"{source} row {i}"
                if not isinstance(item, dict):
                    results.skipped.append(Skipped(where, "", "a row that is not a JSON object"))
                    continue
                row = _row(where, item, table, headers, results.skipped)
                if row is not None:
                    row.file = name
                    rows.append(row)
            continue
        if "op" not in obj:
            if "header" in obj:
                headers[_mode(obj.get("mode"))] = str(obj["header"])
                rows.append(Row(source, _mode(obj.get("mode")), "", 0, 0, 0, 0, 0, 0, -1, header=obj["header"]))
            else:
                results.skipped.append(Skipped(source, "", "a JSON object without \"op\""))
            continue
        row = _row(source, obj, {}, headers, results.skipped)
        if row is not None:
            row.file = name
            rows.append(row)
    return rows


def _split_runs(rows: List[Row], first_run: int) -> int:
    """Numbers rows by run: a run (one epx-bench invocation) ends where an (mode, op, SMs) comes again, where a
    mode comes back after another one, or at a second header of a mode. Returns the number of runs."""
    run, seen, modes, last_mode = first_run, set(), set(), None
    started = False
    for row in rows:
        key = (row.mode, row.op, row.num_sms)
        header_again = not row.op and row.mode in modes
        mode_again = row.mode != last_mode and row.mode in modes
        if started and (key in seen or header_again or mode_again):
            run, seen, modes = run + 1, set(), set()
        if row.op:
            seen.add(key)
        modes.add(row.mode)
        last_mode = row.mode
        started = True
        row.run = run
    return run - first_run + 1 if started else 0


def _name_tokens(path: str) -> Optional[int]:
    stem = os.path.splitext(os.path.basename(path))[0]
    numbers = _NUMBER_IN_NAME.findall(stem)
    return int(numbers[0]) if len(numbers) == 1 and int(numbers[0]) > 0 else None


def _counts(text: Optional[str], option: str) -> Optional[List[int]]:
    if text is None or text == "":
        return None
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        raise PlotError(f"{option} {text!r}: must be a comma-separated list of integers") from None
    if any(c <= 0 for c in counts):
        raise PlotError(f"{option} {text!r}: token counts must be > 0")
    return counts


def parse_texts(named_texts: Sequence[Tuple[str, str]], tokens: Optional[Sequence[int]] = None,
                ll_tokens: Optional[Sequence[int]] = None) -> Results:
    """Parses (name, text) pairs of benchmark JSON into Results. tokens / ll_tokens: one token count per run
    (all runs of all inputs, in order) for the normal-mode / low-latency rows whose JSON has none."""
    results = Results(sources=[name for name, _ in named_texts])
    all_rows: List[Row] = []
    file_runs: List[Tuple[str, List[Row], int, int]] = []  # name, rows, first run, number of runs
    next_run = 0
    for name, text in named_texts:
        rows = _file_rows(text, name, results)
        count = _split_runs(rows, next_run)
        file_runs.append((name, rows, next_run, count))
        next_run += count
        all_rows.extend(rows)
    for option, counts in (("--tokens", tokens), ("--ll-tokens", ll_tokens)):
        if counts is not None and len(counts) != next_run:
            raise PlotError(f"{option} lists {len(counts)} token count(s), the inputs hold {next_run} run(s)")

    for name, rows, first, count in file_runs:
        for run in range(first, first + count):
            run_rows = [r for r in rows if r.run == run and r.op]
            has_normal = any(r.mode == NORMAL for r in run_rows)
            from_name = _name_tokens(name) if count == 1 else None
            where = name if count == 1 else f"{name} (run {run - first + 1} of {count})"
            for mode in (NORMAL, LOW_LATENCY):
                missing = [r for r in run_rows if r.mode == mode and r.tokens is None]
                if not missing:
                    continue
                given, origin = None, ""
                if mode == NORMAL and tokens is not None:
                    given, origin = tokens[run], "--tokens"
                elif mode == LOW_LATENCY and ll_tokens is not None:
                    given, origin = ll_tokens[run], "--ll-tokens"
                elif mode == LOW_LATENCY and tokens is not None and not has_normal:
                    given, origin = tokens[run], "--tokens"
                elif from_name is not None and (mode == NORMAL or not has_normal):
                    given, origin = from_name, "the file name"
                if given is None:
                    results.notes.append(f"{where}: {mode} rows carry no token count (name the file after it, "
                                         f"or pass {'--ll-tokens' if mode == LOW_LATENCY else '--tokens'})")
                    continue
                for r in missing:
                    r.tokens = given
                results.notes.append(f"{where}: {mode} rows at {given} tokens/rank (from {origin})")
    results.rows = [r for r in all_rows if r.op]
    return results


def read_files(paths: Sequence[str], tokens: Optional[Sequence[int]] = None,
               ll_tokens: Optional[Sequence[int]] = None) -> Results:
    """parse_texts over files ("-" reads standard input)."""
    named = []
    for path in paths:
        try:
            if path == "-":
                named.append(("<stdin>", sys.stdin.read()))
            else:
                with open(path, encoding="utf-8") as handle:
                    named.append((path, handle.read()))
        except (OSError, UnicodeDecodeError) as error:
            raise PlotError(f"cannot read {path}: {error}") from None
    return parse_texts(named, tokens, ll_tokens)


# ---- Series and figures (no matplotlib) ----


@dataclass
class Series:
    """One line (or group of bars) of a figure: x values and the matching GB/s and microseconds."""

    label: str
    op: str
    baseline: bool  # NCCL
    x: List[float]
    gbps: List[float]
    us: List[float]
    num_sms: int = 0


@dataclass
class FigureSpec:
    """What one output figure shows: kind "sms" | "ll-ops" | "tokens-normal" | "tokens-ll"."""

    name: str  # file name without the extension
    kind: str
    mode: str
    title: str
    context: str  # shape line: the JSON's header, or what is known (ranks, tokens)
    bytes_note: str
    series: List[Series]
    tokens: Optional[int] = None
    sources: List[str] = field(default_factory=list)  # the inputs its rows came from


def _header_parts(header: str, mode: str) -> Tuple[str, str]:
    """(shape, byte-count definition) from a header "normal mode: ... (GB/s = ...; verified ...)"."""
    if "(GB/s" in header:
        shape, rest = header.split("(GB/s", 1)
        definition = "GB/s" + rest.rstrip().rstrip(")")
        return shape.strip(), definition.split(";")[0].strip()
    return header.strip(), BYTES_DEFINITION[mode]


def _context(rows: Sequence[Row], mode: str, with_tokens: bool, machine: str) -> Tuple[str, str]:
    headers = {r.header if with_tokens else _TOKENS_IN_HEADER.sub("T tokens/rank", r.header)
               for r in rows if r.header}
    if len(headers) == 1:
        shape, definition = _header_parts(headers.pop(), mode)
    else:
        ranks = sorted({r.num_ranks for r in rows})
        tokens = sorted({r.tokens for r in rows if r.tokens})
        parts = [f"{mode} mode", f"{'/'.join(map(str, ranks))} rank{'s' if ranks != [1] else ''}"]
        if with_tokens and len(tokens) == 1:
            parts.append(f"{tokens[0]} tokens/rank")
        shape, definition = ", ".join(parts), BYTES_DEFINITION[mode]
    if machine:
        shape = f"{machine}; {shape}"
    return shape, definition


def _merge(rows: Sequence[Row], key, notes: List[str]) -> Dict[Any, Row]:
    """Rows by key; rows with the same key (repeated runs) are averaged into one, with a note."""
    groups: Dict[Any, List[Row]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    merged = {}
    for k, group in groups.items():
        if len(group) == 1:
            merged[k] = group[0]
            continue
        n = len(group)
        first = group[0]
        merged[k] = Row(source=", ".join(r.source for r in group), mode=first.mode, op=first.op,
                        num_sms=first.num_sms, num_ranks=first.num_ranks,
                        mean_us=sum(r.mean_us for r in group) / n, slowest_us=sum(r.slowest_us for r in group) / n,
                        gbps_mean=sum(r.gbps_mean for r in group) / n, gbps_min=sum(r.gbps_min for r in group) / n,
                        run=first.run, tokens=first.tokens, header=first.header)
        tokens = f" at {first.tokens} tokens/rank" if first.tokens else ""
        notes.append(f"{first.mode} {first.op!r} ({first.num_sms} SMs{tokens}): mean of {n} runs")
    return merged


def _op_order(rows: Iterable[Row]) -> List[str]:
    """Ops in the order they first appear, EPX before NCCL."""
    seen: List[str] = []
    for row in rows:
        if row.op not in seen:
            seen.append(row.op)
    return [op for op in seen if not op.startswith("NCCL")] + [op for op in seen if op.startswith("NCCL")]


def _files(rows: Iterable[Row]) -> List[str]:
    return list(dict.fromkeys(r.file for r in rows if r.file))


def plan_figures(results: Results, stat: str = "mean") -> List[FigureSpec]:
    """The figures the rows give: per token count a GB/s-against-SMs figure (normal mode) and a per-op figure
    (low latency); with several token counts, GB/s against tokens (normal) and GB/s and microseconds against
    tokens (low latency). stat: "mean" over ranks or "min" (the slowest rank)."""
    if stat not in ("mean", "min"):
        raise PlotError(f"--stat {stat!r}: must be mean or min")
    figures: List[FigureSpec] = []
    notes = results.notes
    for mode in (NORMAL, LOW_LATENCY):
        rows = [r for r in results.rows if r.mode == mode]
        if not rows:
            continue
        rank_counts = sorted({r.num_ranks for r in rows})
        # One figure per (tokens, ranks); rows without a token count group by run.
        groups: Dict[Tuple[Any, int], List[Row]] = {}
        for row in rows:
            groups.setdefault((row.tokens if row.tokens else f"run{row.run + 1}", row.num_ranks), []).append(row)
        group_keys = sorted(groups, key=lambda k: (not isinstance(k[0], int), k[0] if isinstance(k[0], int) else 0,
                                                   str(k[0]), k[1]))
        for tokens, ranks in group_keys:
            group = groups[(tokens, ranks)]
            merged = _merge(group, lambda r: (r.op, r.num_sms), notes)
            parts = []
            if len(group_keys) > 1 or isinstance(tokens, int):
                parts.append(f"t{tokens}" if isinstance(tokens, int) else str(tokens))
            if len(rank_counts) > 1:
                parts.append(f"{ranks}ranks")
            name = "-".join(["normal-sms" if mode == NORMAL else "low-latency"] + parts)
            context, note = _context(group, mode, True, results.machine)
            series: List[Series] = []
            for op in _op_order(merged.values()):
                op_rows = sorted((r for r in merged.values() if r.op == op), key=lambda r: r.num_sms)
                series.append(Series(label=op, op=op, baseline=op_rows[0].baseline,
                                     x=[float(r.num_sms) for r in op_rows],
                                     gbps=[r.value("gbps", stat) for r in op_rows],
                                     us=[r.value("us", stat) for r in op_rows]))
            if mode == NORMAL:
                title = "EPX normal mode: GB/s against SM budget (NCCL all-to-all of the same run as lines)"
                figures.append(FigureSpec(name, "sms", mode, title, context, note, series,
                                          tokens if isinstance(tokens, int) else None, _files(group)))
            else:
                title = "EPX low-latency mode: GB/s and latency per op, NCCL beside EPX"
                figures.append(FigureSpec(name, "ll-ops", mode, title, context, note, series,
                                          tokens if isinstance(tokens, int) else None, _files(group)))

        known = [r for r in rows if r.tokens]
        for ranks in rank_counts:
            ranked = [r for r in known if r.num_ranks == ranks]
            token_counts = sorted({r.tokens for r in ranked})
            if len(token_counts) < 2:
                continue
            merged = _merge(ranked, lambda r: (r.op, r.num_sms, r.tokens), [])
            sms_counts = sorted({r.num_sms for r in merged.values() if not r.baseline})
            series = []
            for op in _op_order(merged.values()):
                for sms in sorted({r.num_sms for r in merged.values() if r.op == op}):
                    line = sorted((r for r in merged.values() if r.op == op and r.num_sms == sms),
                                  key=lambda r: r.tokens or 0)
                    label = op + (f", {sms} SMs" if sms and len(sms_counts) > 1 else "")
                    series.append(Series(label=label, op=op, baseline=line[0].baseline,
                                         x=[float(r.tokens or 0) for r in line],
                                         gbps=[r.value("gbps", stat) for r in line],
                                         us=[r.value("us", stat) for r in line], num_sms=sms))
            name = ("normal-tokens" if mode == NORMAL else "low-latency-tokens") + (
                f"-{ranks}ranks" if len(rank_counts) > 1 else "")
            context, note = _context(ranked, mode, False, results.machine)
            if mode == NORMAL:
                sms_text = f" ({sms_counts[0]} SMs)" if len(sms_counts) == 1 else ""
                title = f"EPX normal mode: GB/s against tokens per rank{sms_text}, NCCL dashed"
                figures.append(FigureSpec(name, "tokens-normal", mode, title, context, note, series,
                                          sources=_files(ranked)))
            else:
                title = "EPX low-latency mode: GB/s and latency against tokens per rank, NCCL dashed"
                figures.append(FigureSpec(name, "tokens-ll", mode, title, context, note, series,
                                          sources=_files(ranked)))
    return figures


def describe(results: Results, figures: Sequence[FigureSpec]) -> List[str]:
    """Text of --list: every figure's series, then what was skipped and the notes."""
    lines = []
    for fig in figures:
        lines.append(f"{fig.name}: {fig.title}")
        lines.append(f"  {fig.context}")
        for s in fig.series:
            xs = ", ".join(f"{x:g}" for x in s.x)
            gbps = ", ".join(f"{v:.1f}" for v in s.gbps)
            us = ", ".join(f"{v:.1f}" for v in s.us)
            axis = "tokens" if fig.kind.startswith("tokens") else "SMs"
            lines.append(f"  {s.label}{' (baseline)' if s.baseline else ''}: {axis} [{xs}] GB/s [{gbps}] us [{us}]")
    lines.extend(summary(results))
    return lines


def summary(results: Results) -> List[str]:
    lines = []
    if results.skipped:
        lines.append(f"skipped {len(results.skipped)} row(s) that cannot be plotted:")
        lines.extend(f"  {s}" for s in results.skipped)
    lines.extend(f"note: {n}" for n in results.notes)
    return lines


# ---- Drawing (matplotlib, imported here only) ----


class MissingMatplotlib(PlotError):
    pass


def _matplotlib():
    """(Figure, FigureCanvasAgg, MaxNLocator, FixedLocator, NullLocator, ScalarFormatter); raises
    MissingMatplotlib when it is not installed. No pyplot: nothing global changes in the caller's
    matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    except ImportError as error:
        raise MissingMatplotlib(f"drawing needs matplotlib, which is not installed ({error}): "
                                "pip install matplotlib (--list works without it)") from None
    return Figure, FigureCanvasAgg, FixedLocator, NullLocator, ScalarFormatter


_EPX_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
               "#bcbd22", "#7f7f7f")
_NCCL_COLORS = ("#333333", "#888888", "#555555", "#aaaaaa")
_NCCL_DASHES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


_SMS_MARKERS = ("o", "^", "D", "v", "P", "X", "*")


def _styles(series: Sequence[Series]) -> List[Dict[str, Any]]:
    """Colour by op (EPX in colour, NCCL in greys, dashed); with several SM budgets, the marker by budget."""
    epx_ops = [op for op in dict.fromkeys(s.op for s in series if not s.baseline)]
    nccl_ops = [op for op in dict.fromkeys(s.op for s in series if s.baseline)]
    budgets = sorted({s.num_sms for s in series if not s.baseline})
    out = []
    for s in series:
        if s.baseline:
            i = nccl_ops.index(s.op)
            out.append({"color": _NCCL_COLORS[i % len(_NCCL_COLORS)], "linestyle": _NCCL_DASHES[i % len(_NCCL_DASHES)],
                        "marker": "s"})
        else:
            marker = _SMS_MARKERS[budgets.index(s.num_sms) % len(_SMS_MARKERS)] if len(budgets) > 1 else "o"
            out.append({"color": _EPX_COLORS[epx_ops.index(s.op) % len(_EPX_COLORS)], "linestyle": "-",
                        "marker": marker})
    return out


def _titles(fig: Any, spec: FigureSpec, stat: str) -> None:
    stat_text = "mean over ranks" if stat == "mean" else "slowest rank"
    fig.suptitle(f"{spec.title}\n{spec.context}", fontsize=10)
    sources = spec.sources
    shown = ", ".join(os.path.basename(s) for s in sources[:4]) + (" ..." if len(sources) > 4 else "")
    fig.text(0.01, 0.01, f"{spec.bytes_note}; values: {stat_text}. From {shown}", fontsize=7, color="#444444",
             ha="left", va="bottom", wrap=True)


def _draw_sms(fig: Any, spec: FigureSpec, stat: str, mpl: Tuple[Any, ...]) -> None:
    _, _, FixedLocator, _, _ = mpl
    ax = fig.add_subplot(1, 1, 1)
    budgets = sorted({x for s in spec.series if not s.baseline for x in s.x})
    for s, style in zip(spec.series, _styles(spec.series)):
        if s.baseline:  # NCCL takes no SM budget: its GB/s across the whole axis
            value = s.gbps[0]
            ax.axhline(value, color=style["color"], linestyle=style["linestyle"], linewidth=1.4,
                       label=f"{s.label} (no SM budget): {value:.0f} GB/s")
        else:
            ax.plot(s.x, s.gbps, label=s.label, color=style["color"], marker=style["marker"], linewidth=1.8)
    if budgets:
        ax.xaxis.set_major_locator(FixedLocator(budgets))
        pad = max(2.0, 0.08 * (budgets[-1] - budgets[0]))
        ax.set_xlim(budgets[0] - pad, budgets[-1] + pad)
    ax.set_xlabel("SM budget (num_sms of the normal kernels)")
    ax.set_ylabel(f"GB/s per rank ({'mean over ranks' if stat == 'mean' else 'slowest rank'})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def _draw_ll_ops(fig: Any, spec: FigureSpec, stat: str, mpl: Tuple[Any, ...]) -> None:
    labels = [s.label for s in spec.series]
    styles = _styles(spec.series)
    positions = list(range(len(labels)))[::-1]
    for column, (what, unit) in enumerate((("gbps", "GB/s per rank"), ("us", "latency (µs)"))):
        ax = fig.add_subplot(1, 2, column + 1)
        values = [s.gbps[0] if what == "gbps" else s.us[0] for s in spec.series]
        bars = ax.barh(positions, values, color=[st["color"] for st in styles], edgecolor="black", linewidth=0.4)
        for bar, s in zip(bars, spec.series):
            if s.baseline:
                bar.set_hatch("//")
                bar.set_facecolor("#cccccc")
        for pos, value in zip(positions, values):
            ax.text(value, pos, f" {value:.1f}", va="center", fontsize=7)
        ax.set_yticks(positions)
        ax.set_yticklabels(labels if column == 0 else [""] * len(labels), fontsize=8)
        ax.set_xlabel(f"{unit} ({'mean over ranks' if stat == 'mean' else 'slowest rank'})")
        ax.set_xlim(0, max(values) * 1.2 if values else 1)
        ax.grid(True, axis="x", alpha=0.3)


def _token_axis(ax: Any, tokens: Sequence[float], mpl: Tuple[Any, ...]) -> None:
    _, _, FixedLocator, NullLocator, ScalarFormatter = mpl
    if tokens and min(tokens) > 0 and max(tokens) / min(tokens) >= 4:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_locator(FixedLocator(sorted(tokens)))
    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    ax.xaxis.set_major_formatter(formatter)
    ax.set_xlabel("tokens per rank")
    ax.grid(True, alpha=0.3)


def _draw_tokens(fig: Any, spec: FigureSpec, stat: str, mpl: Tuple[Any, ...]) -> None:
    panels = [("gbps", "GB/s per rank")] + ([("us", "latency (µs)")] if spec.kind == "tokens-ll" else [])
    tokens = sorted({x for s in spec.series for x in s.x})
    for column, (what, unit) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), column + 1)
        for s, style in zip(spec.series, _styles(spec.series)):
            ys = s.gbps if what == "gbps" else s.us
            ax.plot(s.x, ys, label=s.label, color=style["color"], linestyle=style["linestyle"],
                    marker=style["marker"], linewidth=1.4 if s.baseline else 1.8)
        _token_axis(ax, tokens, mpl)
        ax.set_ylabel(f"{unit} ({'mean over ranks' if stat == 'mean' else 'slowest rank'})")
        ax.set_ylim(bottom=0)
        if column == len(panels) - 1:  # outside the last panel, on the right
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def draw(figures: Sequence[FigureSpec], out_dir: str, stat: str = "mean",
         formats: Sequence[str] = FORMATS) -> List[str]:
    """Draws every figure into out_dir as <name>.<format>; returns the paths written. Raises
    MissingMatplotlib without matplotlib."""
    mpl = _matplotlib()
    Figure, FigureCanvasAgg = mpl[0], mpl[1]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for spec in figures:
        wide = spec.kind in ("ll-ops", "tokens-ll")
        height = 5.2 if spec.kind != "ll-ops" else max(4.5, 1.2 + 0.38 * len(spec.series))
        fig = Figure(figsize=(14.0 if wide else 11.0, height))
        FigureCanvasAgg(fig)
        if spec.kind == "sms":
            _draw_sms(fig, spec, stat, mpl)
        elif spec.kind == "ll-ops":
            _draw_ll_ops(fig, spec, stat, mpl)
        else:
            _draw_tokens(fig, spec, stat, mpl)
        fig.tight_layout(rect=(0, 0.05, 1, 0.9))
        _titles(fig, spec, stat)
        for fmt in formats:
            path = os.path.join(out_dir, f"{spec.name}.{fmt}")
            fig.savefig(path, format=fmt, dpi=130)
            written.append(path)
    return written


# ---- Command line ----


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Plots of epx-bench / python -m epx_tools.bench JSON results (PNG and SVG).",
        epilog="Token counts: a num_tokens field or '<T> tokens/rank' header in the JSON, else --tokens, else a "
               "lone number in the file name (bench-4096.json).")
    p.add_argument("paths", nargs="+", metavar="RESULTS.json", help="JSON lines of --json-file ('-': stdin)")
    p.add_argument("--out", default=".", metavar="DIR", help="folder for the PNG and SVG files (default: .)")
    p.add_argument("--tokens", default=None, metavar="T,T,...",
                   help="tokens per rank of each run, in input order, for rows whose JSON has none")
    p.add_argument("--ll-tokens", default=None, metavar="T,T,...",
                   help="low-latency tokens per rank of each run, in input order")
    p.add_argument("--machine", default="", help="machine line for the titles (e.g. '8 x H200')")
    p.add_argument("--stat", choices=("mean", "min"), default="mean",
                   help="mean over ranks (default), or min: the slowest rank's GB/s and time")
    p.add_argument("--list", action="store_true", help="print the series instead of drawing (no matplotlib)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    o = build_parser().parse_args(argv)
    try:
        results = read_files(o.paths, _counts(o.tokens, "--tokens"), _counts(o.ll_tokens, "--ll-tokens"))
        if o.machine:
            results.machine = o.machine
        figures = plan_figures(results, o.stat)
        if o.list:
            print("\n".join(describe(results, figures)))
            return 0 if figures else 1
        if not figures:
            print("\n".join(summary(results)))
            print(f"{PROG}: nothing to plot in {', '.join(o.paths)}", file=sys.stderr)
            return 1
        written = draw(figures, o.out, o.stat)
    except PlotError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    for spec in figures:
        print(f"wrote {os.path.join(o.out, spec.name)}.{{{','.join(FORMATS)}}}: {spec.title}")
    lines = summary(results)
    if lines:
        print("\n".join(lines))
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
