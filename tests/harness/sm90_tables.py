"""The tables of docs/kernels.md's "Compiled code for sm_90" section, made from the results of
sm90_compile_check.py (``--markdown`` prints them; a test compares them with the docs)."""

from __future__ import annotations

ATTENTION = {  # kernel: its name in the tables, in their order
    "_flash_alibi_fwd_kernel": "forward",
    "_flash_alibi_bwd_kernel": "backward",
    "_flash_alibi_bwd_dq_kernel": "backward dQ",
}
TABLE_START = "<!-- sm90 tables: "
TABLE_END = "<!-- end of sm90 tables -->"


def _usage(r: dict) -> str:
    return f"{r['registers']} / {r['spill_bytes']} / {round(r['shared_bytes'] / 1024)}"


def _attention_cell(r: dict) -> str:
    return f"{_usage(r)} / {r['mma_sync']}"


def markdown_tables(results: list[dict]) -> str:
    """Attention: a row per (kernel, dropout, tile, warps, stages), a column per head_dim
    (registers / spill bytes / shared KiB / mma.sync instructions). Every other kernel: a row
    per compiled variant."""
    head_dims = sorted({r["constexprs"]["HEAD_DIM"] for r in results if r["kernel"] in ATTENTION})
    rows: dict[tuple, dict[int, str]] = {}
    dots: dict[tuple, set[str]] = {}
    for r in results:
        if r["kernel"] not in ATTENTION:
            continue
        c = r["constexprs"]
        key = (
            ATTENTION[r["kernel"]],
            "yes" if c["DROPOUT"] else "no",
            "yes" if c["SEGMENTS"] else "no",
            f"{c['BLOCK_M']}x{c['BLOCK_N']} w{r['num_warps']} s{r['num_stages']}",
        )
        rows.setdefault(key, {})[c["HEAD_DIM"]] = _attention_cell(r)
        dots.setdefault(key, set()).add(",".join(map(str, sorted(set(r["loop_dots"])))))
    lines = [
        "| kernel | dropout | segments | tile M x N, warps, stages | "
        + " | ".join(f"d{d}" for d in head_dims)
        + " | dots / iteration |",
        "| --- " * (len(head_dims) + 5) + "|",
    ]
    order = list(ATTENTION.values())
    for key in sorted(rows, key=lambda k: (order.index(k[0]), *k[1:])):
        cells = [rows[key].get(d, "") for d in head_dims]
        lines.append(
            f"| {' | '.join(key)} | {' | '.join(cells)} | {' / '.join(sorted(dots[key]))} |"
        )
    lines += ["", "| kernel | constexprs | warps | registers / spill bytes / shared KiB |",
              "| --- | --- | --- | --- |"]  # fmt: skip
    seen = set()
    for r in results:
        if r["kernel"] in ATTENTION:
            continue
        constexprs = ", ".join(f"{k} {v}" for k, v in sorted(r["constexprs"].items()))
        row = f"| {r['kernel']} | {constexprs} | {r['num_warps']} | {_usage(r)} |"
        if row not in seen:
            seen.add(row)
            lines.append(row)
    return "\n".join(lines)


def documented_tables(text: str) -> tuple[str, str]:
    """(the Triton version named in the start marker, the tables between the markers) of a
    document's sm90 tables."""
    start = text.index(TABLE_START)
    header_end = text.index("-->", start)
    version = text[start + len(TABLE_START) : header_end].split("Triton ")[-1].strip()
    body = text[header_end + len("-->") : text.index(TABLE_END)].strip()
    return version, body
