"""`rag-retriever plan`'s text: a plan (`plan.make_plan`) as the lines the command prints, each
figure beside what it rests on (measured, interpolated or extrapolated, and how far), what the
constants could not know, and the recommendation."""

from __future__ import annotations

from rag_retriever.ops.plan import (
    MEMORY_SHARE,
    Plan,
    measured_width,
    recall_credited,
    search_asked,
)


def _build_memory_lines(plan: Plan) -> list[str]:
    """Where a build's memory peaks, against a machine's: a build that does not fit must run on
    a larger machine, or per node of the cluster."""
    b = plan.brief
    lines = []
    for s in plan.settings:
        if s.build_memory_gb is None or s.node_build_memory_gb is None:
            lines.append(
                f"{s.quantization}: build peak not in these constants (re-measure with "
                f"`python -m bench.bench_engine --constants-out FILE`)"
            )
            continue
        limit, size = b.memory_gb * MEMORY_SHARE, f" {b.memory_gb:g} GB"
        if s.build_private_gb is None or s.node_build_private_gb is None:
            lines.append(
                f"{s.quantization}: a build peaks at {s.build_memory_gb:.1f} GB on one machine "
                f"({_build_fit(s.build_memory_gb, s.build_memory_gb, limit, size)}), "
                f"{s.node_build_memory_gb:.1f} GB a node of {b.nodes} "
                f"({_build_fit(s.node_build_memory_gb, s.node_build_memory_gb, limit)})"
            )
            continue
        machine = _build_fit(s.build_memory_gb, s.build_private_gb, limit, size)
        lines.append(
            f"{s.quantization}: a build peaks at {s.build_memory_gb:.1f} GB RSS on one machine, "
            f"{s.build_private_gb:.1f} GB of it private ({machine}); "
            f"{s.node_build_memory_gb:.1f} GB, {s.node_build_private_gb:.1f} GB private, a node "
            f"of {b.nodes} ({_build_fit(s.node_build_memory_gb, s.node_build_private_gb, limit)})"
        )
    if any(s.build_private_gb is not None for s in plan.settings):
        lines.append(
            "a build's RSS beyond its private memory is mapped shard files: the kernel can page "
            "them out and read them again, so a build whose private memory fits still runs, "
            "slower by those reads (not measured)"
        )
    return lines


def _build_fit(rss_gb: float, private_gb: float, limit_gb: float, machine: str = "") -> str:
    """Whether a build fits `limit_gb`: whole, only with its mapped shard files paged (its
    private memory fits), or not at all."""
    if rss_gb <= limit_gb:
        return f"fits{machine}"
    if private_gb <= limit_gb:
        return f"fits{machine} only by paging shard files from disk"
    return f"does NOT fit{machine}"


def describe(plan: Plan) -> list[str]:
    """The plan as lines for a terminal."""
    b = plan.brief
    m = plan.measured
    lines = [
        f"brief: {b.chunks:,} chunks, {b.qps:g} queries/s at p95 <= {b.p95_ms:g} ms, "
        f"{b.edits_per_day:,} edits a day of ~{b.chunks_per_edit:g} chunks; machines of "
        f"{b.memory_gb:g} GB and {b.cores} cores; a cluster of {b.nodes} nodes",
        f"constants: measured {m.get('date', '?')} on {m.get('cores', '?')} cores / "
        f"{m.get('memory_gb', '?')} GB with `{m.get('command', '?')}`",
    ]
    if plan.extrapolated_by > 1:
        lines.append(
            f"EXTRAPOLATED: {b.chunks:,} chunks is {plan.extrapolated_by:.1f}x the largest size "
            f"measured ({plan.largest_measured:,}); each figure follows its fitted growth n^e"
        )
    else:
        lines.append(f"within the measured sizes (largest {plan.largest_measured:,} chunks)")
    for s in plan.settings:
        if b.chunks > s.largest_measured > 0 and s.largest_measured < plan.largest_measured:
            lines.append(
                f"EXTRAPOLATED: {s.quantization} was measured up to {s.largest_measured:,} "
                f"chunks: {b.chunks / s.largest_measured:.1f}x that"
            )
    if plan.ef_construct != plan.measured_ef_construct:
        lines.append(
            f"NOT MEASURED AT THIS WIDTH: graphs built at ef_construct {plan.ef_construct} "
            f"(RAG_HNSW_EF_CONSTRUCT or --hnsw-ef-construct), the constants' at "
            f"{plan.measured_ef_construct}: the build times and latencies below are those of "
            f"{plan.measured_ef_construct}, not scaled (compare the two with `python -m "
            f"bench.bench_engine --ef-construct {plan.measured_ef_construct} {plan.ef_construct}`)"
        )
    shards = plan.settings[0].shards if plan.settings else 1
    if shards > 1:
        node = plan.settings[0].node_shards
        lines.append(
            f"embedded: {b.chunks:,} chunks are {shards} base shards of ~{b.chunks / shards:,.0f} "
            f"(RAG_BASE_SHARD_POINTS {plan.shard_points:,}), {node} a node of {b.nodes}: a query "
            f"asks each in turn (latency: k x one shard's), a build seals "
            f"one at a time, each written and sealed by a process of its own (its peak: one shard's)"
        )
    for s in plan.settings:
        if s.shard_extrapolated_by > 1:
            lines.append(
                f"EXTRAPOLATED: {s.quantization}: a shard of ~{b.chunks / s.shards:,.0f} chunks "
                f"is {s.shard_extrapolated_by:.1f}x the largest measured as one shard "
                f"({s.largest_one_shard:,}): its latency, build time and build memory follow "
                f"the fits"
            )
        if s.checked and s.checked_at:
            scaled = ", ".join(f"{k} x{v:.2f}" for k, v in s.checked.items())
            lines.append(
                f"{s.quantization}: {s.checked_at[0]:,} chunks measured as {s.checked_at[1]} "
                f"shards took more than the shard model says, so from that size on {scaled} "
                f"(a share of it from {s.largest_one_shard:,})"
            )
        if s.checked_at is None and s.shards > 1:
            lines.append(
                f"{s.quantization}: never measured as several shards: its latency is the shard "
                f"model's, unchecked"
            )
        if s.other_search:
            at = ", ".join(f"{n:,} ({asked})" for n, asked, _ in s.other_search)
            below = all(narrower for *_, narrower in s.other_search)
            lines.append(
                f"{s.quantization}: searched today at {search_asked(s.quantization)}, measured "
                f"otherwise at {at} chunks: its latency there is "
                f"{'below' if below else 'not'} today's (re-measure with bench_engine)"
            )
        linear_n, linear_mb = s.memory_linear_from
        if b.chunks > linear_n > 0:
            lines.append(
                f"{s.quantization}: memory past {linear_n:,} chunks grows at least in proportion "
                f"from the {linear_mb:,.0f} MB measured there"
            )
    header = (
        f"{'setting':<8} {'memory':>8} {'fits':>4} {'disk':>8} {'build':>7} {'p50':>8} "
        f"{'p95':>8} {'p95@load':>9} {'q/s/mach':>8} {'machines':>8}  "
        f"per node of {b.nodes}: memory, disk, p95"
    )
    lines += [
        "",
        f"one machine (engine + query encoding + {plan.overhead_ms:.1f} ms of the HTTP service a "
        f"query; no reranker):",
        header,
    ]
    for s in plan.settings:
        at_load = f"{s.p95_at_load_ms:.1f}ms" if s.p95_at_load_ms is not None else "overload"
        lines.append(
            f"{s.quantization:<8} {s.memory_gb:>6.1f}GB {'yes' if s.fits_one_machine else 'no':>4} "
            f"{s.disk_gb:>6.1f}GB {s.build_h:>6.1f}h {s.p50_ms:>6.1f}ms {s.p95_ms:>6.1f}ms "
            f"{at_load:>9} {s.machine_qps:>8.0f} {s.machines_for_qps:>8}  "
            f"{s.node_memory_gb:.1f}GB, {s.node_disk_gb:.1f}GB, {s.node_p95_ms:.1f}ms"
        )
    lines.append("")
    for s in plan.settings:
        growth = ", ".join(f"{k} n^{v:.2f}" for k, v in s.exponents.items())
        lines.append(
            f"{s.quantization}: fitted growth {growth}; resident floor (vectors HNSW reads + "
            f"links) {s.resident_floor_gb:.1f} GB"
        )
    lines.append("")
    lines += _build_memory_lines(plan)
    e = plan.edits
    lines.append("")
    lines.append(f"edits: {e['chunks_changed_per_day']:,.0f} chunks changed a day")
    if "edge_writer_busy_share" in e:
        lines.append(
            f"  embedded (Edge): a delta each, {e['edge_edit_s']:.2f} s measured: the writer is "
            f"busy {e['edge_writer_busy_share']:.1%} of the day"
        )
    if "server_points_written_per_day" in e:
        lines.append(
            f"  Qdrant server: {e['server_points_written_per_day']:,.0f} points written a day "
            f"(changed chunks and the marks on the ones they replace; nothing copied)"
        )
    lines.append("")
    if plan.recommended:
        best = next(s for s in plan.settings if s.quantization == plan.recommended)
        lines.append(
            f"recommended: {plan.recommended} (the least memory that fits a machine and, where "
            f"measured, holds the recall), on {best.machines_for_qps} machine(s) each holding the whole index for "
            f"{b.qps:g} q/s: p95 ~{best.p95_replicated_ms:.0f} ms estimated"
        )
    else:
        lines.append(
            f"no setting fits one machine's memory, meets p95 <= {b.p95_ms:g} ms and holds the "
            f"recall: use the cluster figures (per node of {b.nodes})"
        )
    if plan.served:
        v = plan.served
        lines.append(
            f"measured through the HTTP service on the constants' machine at {v['chunks']:,} "
            f"chunks: {v['qps']:g} queries/s offered -> p50 {v['load_p50_ms']:.0f} ms, p95 "
            f"{v['load_p95_ms']:.0f} ms, {v['load_failed']} of {v['load_sent']} failed "
            f"(`{v['command']}`)"
        )
    lines.append(
        "not measured: p95 under load at this size is a queueing estimate from single-client "
        "latency; a cluster's network and fan-out; the reranker's cost"
    )
    if plan.recall:
        r = plan.recall
        # three places: 0.9453 is below a 0.95 asked, and must not read as 0.95
        found = ", ".join(f"{name} {value:.3f}" for name, value in r["dense_at10_of_exact"].items())
        past = b.chunks / float(r["chunks"])
        # a recall that does not say how it searched was measured as every point before
        searched = {
            name: (r.get("searched") or {}).get(name) or search_asked(name, {})
            for name in r["dense_at10_of_exact"]
        }
        stale = [f"{n} at {was}" for n, was in searched.items() if was != search_asked(n)]
        width = measured_width(r)
        short = [
            s.quantization
            for s in plan.settings
            if r["dense_at10_of_exact"].get(s.quantization, 1.0) < b.recall_at10
        ]
        unmeasured = [s.quantization for s in plan.settings if "recall" not in s.meets]
        builds = int(r.get("builds") or 1)  # HNSW graphs built from the same points
        lines.append(
            f"dense recall@10 of an exact search on real embeddings at {r['chunks']:,} chunks, "
            f"the largest measured: {found}"
            + (f", each the mean of {builds} builds of its graph" if builds > 1 else "")
            + (f", built at ef_construct {width}" if width != plan.ef_construct else "")
            + f" (`{r['command']}`); it falls as the index grows"
            + (f", and this brief is {past:.0f}x past it" if past > 1 else "")
            + (f"; searched otherwise than today: {', '.join(stale)}" if stale else "")
        )
        if not recall_credited(r, plan.ef_construct):
            lines.append(
                f"NOT MEASURED AT THIS WIDTH: that recall is of graphs built at ef_construct "
                f"{width}, wider than this deployment's {plan.ef_construct}, which holds less of "
                f"the exact top 10, so no setting is recommended on it (measure at "
                f"{plan.ef_construct}: `python -m bench.bench_quantization --ef-construct "
                f"{plan.ef_construct} --constants-out FILE`)"
            )
        if short:
            lines.append(
                f"below the {b.recall_at10:g} of the exact top 10 asked (--recall-at10), so not "
                f"recommended: {', '.join(short)}"
            )
        if unmeasured:
            lines.append(
                f"recall not measured, so not held to --recall-at10: {', '.join(unmeasured)}"
            )
    return lines
