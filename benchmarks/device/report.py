"""The run's report: ``device.json`` (everything) and ``device.md`` (a summary table and one
table per section), rewritten after every section; and the short summary printed last."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

# Per section, the row fields shown in device.md, in order (only those some row has).
COLUMNS = {
    "environment": ["backend", "device", "devices", "memory_gib", "compute_capability", "driver"],
    "tests": [
        "status",
        "exit_code",
        "collected",
        "passed",
        "failed",
        "errors",
        "skipped",
        "deselected",
        "seconds",
    ],
    "attention": [
        "seq",
        "batch",
        "impl",
        "fwd_ms",
        "fwd_tflops",
        "fwd_bwd_ms",
        "fwd_bwd_tflops",
        "fwd_first_call_s",
        "fwd_bwd_first_call_s",
        "fwd_rel_err",
        "grad_rel_err",
        "check_against",
        "check",
        "error",
    ],
    "train": [
        "remat",
        "attention_impl",
        "parameters",
        "batch",
        "seq",
        "dtype",
        "step_ms",
        "tokens_per_s",
        "tflops",
        "flops_per_token",
        "mfu",
        "compile_s",
        "oom_at_batch",
        "error",
    ],
    "decode": [
        "batch",
        "unstack_layers",
        "prompt",
        "new_tokens",
        "first_call_s",
        "seconds",
        "tokens_per_s",
        "ms_per_step",
        "error",
    ],
    "serve": [
        "impl",
        "requests",
        "prompt",
        "max_tokens",
        "warmup_s",
        "compiled_shapes",
        "seconds",
        "output_tokens",
        "tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "step_p50_ms",
        "recompiled",
        "error",
    ],
}


def cell(value: Any) -> str:
    """A table cell: floats to 4 significant digits, NaN as ``NaN``, None empty; ``|`` and
    newlines escaped for markdown."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_rows(report: dict[str, Any]) -> list[list[Any]]:
    """``[section, status, seconds, budget, headline]`` for every section."""
    rows = []
    for name, section in report["sections"].items():
        headline = section.get("meta", {}).get("headline") or section.get("error") or ""
        rows.append(
            [name, section["status"], section.get("seconds"), section.get("budget_s"), headline]
        )
    return rows


def _section_markdown(name: str, section: dict[str, Any]) -> list[str]:
    """One section's heading, status, error and rows table."""
    lines = [f"## {name}", "", f"status: {section['status']}"]
    if section.get("error"):
        lines += ["", f"error: `{cell(section['error'])}`"]
    for note in section.get("meta", {}).get("skipped", []):
        lines += ["", f"skipped {note}"]
    rows = section.get("rows", [])
    columns = [c for c in COLUMNS.get(name, []) if any(c in r for r in rows)]
    if rows and columns:
        lines += ["", markdown_table(columns, [[r.get(c) for c in columns] for r in rows])]
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    """``device.md``: the run, the summary table, then each section's table."""
    run = report["run"]
    env = report["sections"].get("environment", {}).get("meta", {})
    kind = "dry run (CPU, tiny shapes)" if run["dry_run"] else "full run"
    lines = [
        "# edl device run",
        "",
        f"started {run['started']}, {kind}"
        f", budget {run['budget_s']} s, elapsed {cell(run.get('elapsed_s'))} s"
        f"{'' if run.get('finished') else ' (unfinished)'}",
        f"commit {env.get('git_commit')}, tree digest {env.get('tree_digest')}, "
        f"wheels: {env.get('wheels')}",
        "",
        markdown_table(
            ["section", "status", "seconds", "budget s", "headline"], summary_rows(report)
        ),
        "",
    ]
    for name, section in report["sections"].items():
        lines += _section_markdown(name, section)
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> None:
    """Write ``device.json`` and ``device.md`` into ``out`` (each atomically)."""
    for name, text in (
        ("device.json", json.dumps(report, indent=1, default=str)),
        ("device.md", markdown(report)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
