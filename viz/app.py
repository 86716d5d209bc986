"""The mpipar dashboard (Streamlit): wires plans and timelines to the renderers of ``viz/``.

    streamlit run viz/app.py                                   # the project's GPT plan (or the sample), simulated here
    streamlit run viz/app.py -- plan.json [timeline.json [measured.json]]
    mpipar viz plan.json [timeline.json]                       # the same, bound to 127.0.0.1

Files can also be uploaded in the sidebar (JSON plans and timelines, told apart by their
``format``; nothing is ever unpickled). A file that cannot be read is reported with the field
and value at fault, and the default plan is shown instead. With no file the app opens on
``examples/gpt.py``'s plan (``viz.default_plan``, traced once, cached); the sidebar keeps the
built-in sample one click away. The sidebar's hardware selector prices the plan's ops and
reshards with the simulator's cost model (``viz.plan_time``) on a preset or a calibrated
profile file, so the pipeline and memory views are in seconds. Every figure comes from a pure renderer
(``viz.layout``, ``viz.propagation``, ``viz.stepper``, ``viz.comm``, ``viz.timeline_view``,
``viz.memory``, ``viz.whatif``); this script holds only state, widgets and downloads.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any

import streamlit as st

# `streamlit run viz/app.py` puts viz/ first on sys.path, not the repository: make `import viz` work uninstalled.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from matplotlib.figure import Figure  # noqa: E402

from mpipar.compile.plan import Plan  # noqa: E402
from mpipar.debug.timeline import Timeline  # noqa: E402
from simulator.cost import HardwareProfile, list_presets, load_profile  # noqa: E402
from viz import comm, layout, memory, propagation, script_whatif, search_view, stepper, timeline_view, whatif  # noqa: E402
from viz.default_plan import GPT_ARGS, DefaultPlanError, script_stamp, trace_gpt_plan  # noqa: E402
from viz.escape import literal  # noqa: E402
from viz.figures import to_png, to_svg  # noqa: E402
from viz.files import VizFileError, load_document, load_path  # noqa: E402
from viz.plan_memory import HOST_KEY, with_memory  # noqa: E402
from viz.plan_time import ProfileError, measured_on_lanes, priced, profile_from_bytes, profile_from_path  # noqa: E402
from viz.plan_time import stage_prices as price_stages  # noqa: E402
from viz.planinfo import all_ranks, fmt_bytes, itemsize, tensor_label, tensor_spec  # noqa: E402
from viz.sample import RECOMPUTE_MODES, UNSUPPORTED, ZERO_STAGES, SampleConfig, build_sample  # noqa: E402
from viz.simulate import (  # noqa: E402
    NoPipeline,
    capacity_bytes,
    compatible_kinds,
    plan_cost,
    plan_kind,
    plan_microbatches,
    rank_memory,
    simulate_plan_lanes,
)
from viz.tables import arrow_safe  # noqa: E402

VIEWS = ("Layout", "Propagation", "Reshard stepper", "Communication", "Pipeline", "Memory", "What-if")
ALL = "(all)"
GPT_CHOICE = "GPT (examples/gpt.py)"
SAMPLE_CHOICE = "built-in sample"
OPEN_CHOICES = (GPT_CHOICE, SAMPLE_CHOICE)
GPT_SOURCE = f"examples/gpt.py {' '.join(GPT_ARGS)} (shape-only)"
AS_LOADED = "as loaded"
PROFILE_FILE = "calibrated profile file..."
DEFAULT_PRESET = "cpu-local"


# ------------------------------------------------------------------------------ inputs
def _cli_files() -> list[str]:
    """Paths after ``--`` (Streamlit hands them to the script as its argv)."""
    return [a for a in sys.argv[1:] if not a.startswith("-")]


def _split(docs: list[tuple[str, Plan | Timeline]]) -> tuple[tuple[str, Plan] | None, list[tuple[str, Timeline]]]:
    plans = [(n, d) for n, d in docs if isinstance(d, Plan)]
    timelines = [(n, d) for n, d in docs if isinstance(d, Timeline)]
    return (plans[-1] if plans else None), timelines


@st.cache_resource(max_entries=16, show_spinner=False)
def _sample(dp: int, tp: int, pp: int, schedule: str, microbatches: int) -> tuple[Plan, Timeline]:
    return build_sample(dp, tp, pp, schedule, microbatches)


@st.cache_resource(max_entries=32, show_spinner=False)
def _parse(digest: str, name: str, _data: bytes) -> Plan | Timeline:
    del digest  # the cache key; the bytes are not hashed twice
    return load_document(_data, name)


@st.cache_resource(max_entries=16, show_spinner=False)
def _load_cli(path: str, mtime_ns: int, size: int) -> Plan | Timeline:
    del mtime_ns, size  # the cache key: an edited file is read again
    return load_path(path)


@st.cache_resource(max_entries=4, show_spinner="Tracing examples/gpt.py (shape-only, once)...")
def _gpt_plan(stamp: tuple[int, int]) -> Plan:
    del stamp  # the cache key: an edited example is traced again
    return trace_gpt_plan()


def _cli_doc(path: str) -> tuple[str, Plan | Timeline]:
    try:
        st_ = os.stat(path)
    except OSError:
        return "", load_path(path)  # load_path words the missing/unreadable file
    return f"file:{os.path.abspath(path)}:{st_.st_mtime_ns}:{st_.st_size}", _load_cli(
        path, st_.st_mtime_ns, st_.st_size
    )


def _default_plan() -> tuple[str, str, Plan, Timeline | None]:
    """(key, source label, plan, its timeline) of the plan the sidebar's "Open" choice names."""
    choice = st.sidebar.radio(
        "Open",
        OPEN_CHOICES,
        key="open_plan",
        help="with no file loaded: the project's GPT example, traced shape-only, or the "
        "built-in sample (a residual MLP)",
    )
    if choice == GPT_CHOICE:
        stamp = script_stamp()
        try:
            return f"gpt:{stamp}", GPT_SOURCE, _gpt_plan(stamp), None
        except DefaultPlanError as exc:
            st.warning(f"{literal(exc)}; showing the built-in sample instead.")
    knobs = st.session_state.get("sample_knobs", (2, 2, 2, "1F1B", 4))
    plan, sample_t = _sample(*knobs)
    return f"sample:{knobs}", SAMPLE_CHOICE, plan, sample_t


def _load_inputs() -> tuple[str, str, Plan, Timeline | None, Timeline | None]:
    """(cache key, source label, plan, main timeline, overlay timeline); file errors shown, default plan as fallback."""
    errors: list[str] = []
    docs: list[tuple[str, Plan | Timeline]] = []
    keys: list[str] = []
    for path in _cli_files():
        try:
            key, doc = _cli_doc(path)
        except VizFileError as exc:
            errors.append(str(exc))
            continue
        docs.append((os.path.basename(path), doc))
        keys.append(key)
    uploads = st.sidebar.file_uploader(
        "Open plan / timeline JSON",
        type=["json"],
        accept_multiple_files=True,
        help="mpipar.plan and mpipar.timeline files (a second timeline is overlaid as the measured one)",
    )
    for up in uploads or []:
        data = up.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        try:
            docs.append((up.name, _parse(digest, up.name, data)))
        except VizFileError as exc:
            errors.append(str(exc))
            continue
        keys.append(f"upload:{digest}")
    for e in errors:
        st.error(literal(e), icon="🚫")
    plan_doc, timelines = _split(docs)
    measured = [t for t in timelines if t[1].meta.get("source") == "measured"]
    predicted = [t for t in timelines if t[1].meta.get("source") != "measured"]
    main_t = predicted[0][1] if predicted else None
    overlay = measured[0][1] if measured else (predicted[1][1] if len(predicted) > 1 else None)
    if plan_doc is None:
        key, source, plan, own_t = _default_plan()
        if timelines or errors:
            st.info(
                f"No plan could be loaded; the views below show the {source} plan."
                if errors or not timelines
                else f"Only timelines were loaded; plan views show the {source} plan."
            )
        return key, source, plan, main_t or own_t, overlay
    plan_key = next(k for k, (_, d) in zip(keys, docs, strict=True) if d is plan_doc[1])
    return plan_key, plan_doc[0], plan_doc[1], main_t, overlay


# ------------------------------------------------------------------------------ helpers
def _downloads(fig_fn: Callable[[], Figure], text_fn: Callable[[], str] | None, stem: str, key: str) -> None:
    """PNG / SVG / text download buttons; the bytes are made only when clicked."""
    cols = st.columns(3 if text_fn else 2)
    cols[0].download_button(
        "PNG", lambda: to_png(fig_fn(), dpi=150), f"{stem}.png", "image/png", key=f"{key}-png", on_click="ignore"
    )
    cols[1].download_button(
        "SVG", lambda: to_svg(fig_fn()), f"{stem}.svg", "image/svg+xml", key=f"{key}-svg", on_click="ignore"
    )
    if text_fn:
        cols[2].download_button(
            "text", lambda: text_fn().encode(), f"{stem}.txt", "text/plain", key=f"{key}-txt", on_click="ignore"
        )


def _show(fig: Figure) -> None:
    st.pyplot(fig, clear_figure=False)


def _choice(label: str, options: list[Any], key: str, fmt: Callable[[Any], str] = str) -> Any:
    value = st.selectbox(
        label, [ALL, *options], key=key, format_func=lambda v: v if v == ALL else literal(fmt(v), markdown=False)
    )
    return None if value == ALL else value


# ------------------------------------------------------------------------------ views
def view_layout(plan: Plan) -> None:
    tensors = [t for t in plan.tensors if t.mesh is not None]
    if not tensors:
        st.info("This plan has no distributed tensor.")
        return
    # Open on the most interesting parameter: the one split into the most blocks.
    blocks = [len(set(t.local_shapes)) + len(t.shape) if t.kind == "parameter" else -1 for t in tensors]
    default = max(range(len(tensors)), key=lambda i: (blocks[i], -i))
    t = st.selectbox(
        "Tensor",
        tensors,
        index=default,
        format_func=lambda x: literal(tensor_label(x), markdown=False),
        key="layout_tensor",
    )
    spec = tensor_spec(plan, t)
    assert spec is not None
    nd = len(t.shape)
    dims = list(layout.default_dims(spec))
    at = [0] * nd
    if nd > 2:
        c1, c2 = st.columns(2)
        d0 = c1.selectbox("rows: dim", list(range(nd)), index=dims[0], key="layout_d0")
        d1 = c2.selectbox(
            "columns: dim",
            [d for d in range(nd) if d != d0],
            index=max(0, [d for d in range(nd) if d != d0].index(dims[1]) if dims[1] != d0 else 0),
            key="layout_d1",
        )
        dims = sorted([d0, d1])
        for d in range(nd):
            if d not in dims and t.shape[d] > 1:
                at[d] = st.slider(f"position on dim {d}", 0, t.shape[d] - 1, 0, key=f"layout_at{d}")
    size = itemsize(t.dtype)
    left, right = st.columns(2)
    with left:
        _show(layout.tensor_tiles_figure(spec, t.name or f"#{t.id}", dims, at))
    with right:
        _show(layout.mesh_grid_figure(spec, size, t.name or f"#{t.id}"))
    _downloads(
        lambda: layout.tensor_tiles_figure(spec, t.name or f"#{t.id}", dims, at),
        lambda: layout.layout_text(spec, t.name or f"#{t.id}", size, dims, at),
        f"layout-{t.id}",
        "layout",
    )
    with st.expander("What each rank holds"):
        st.dataframe(arrow_safe(layout.rank_table(spec, size)), hide_index=True)


def view_propagation(plan: Plan) -> None:
    choices = propagation.filter_choices(plan)
    c = st.columns(4)
    with c[0]:
        layer = _choice("Layer", choices["layer"], "trace_layer")
    with c[1]:
        names = {t.id: literal(tensor_label(t), markdown=False) for t in plan.tensors}
        tensor = _choice("Tensor", choices["tensor"], "trace_tensor", lambda i: names[i])
    with c[2]:
        collective = _choice("Collective", choices["collective"], "trace_collective")
    with c[3]:
        phase = _choice("Phase", choices["phase"], "trace_phase")
    rows = propagation.trace_rows(plan, layer, tensor, collective, phase)
    st.caption(f"{len(rows)} row(s); reshards inserted by the rules or by autograd are highlighted.")
    if rows:
        import pandas as pd

        frame = pd.DataFrame(arrow_safe(rows))

        def highlight(row: Any) -> list[str]:
            color = "background-color: #FDE2C4" if row["row"] == "reshard" else ""
            return [color] * len(row)

        st.dataframe(frame.style.apply(highlight, axis=1), hide_index=True)
    st.download_button(
        "trace as text",
        lambda: propagation.trace_text(plan, layer, tensor, collective, phase).encode(),
        "trace.txt",
        "text/plain",
        key="trace-txt",
        on_click="ignore",
    )


def view_stepper(plan: Plan) -> None:
    reshards = [r for r in plan.reshards if r.steps]
    if not reshards:
        st.info("This plan has no reshard with a step.")
        return
    labels = {
        r.index: literal(propagation.reshard_text(plan, r) + (f"  ({r.reason})" if r.reason else ""), markdown=False)
        for r in reshards
    }
    default = next((i for i, r in enumerate(reshards) if len(r.steps) > 1), 0)
    r = st.selectbox("Reshard", reshards, index=default, format_func=lambda x: labels[x.index], key="step_reshard")
    n = len(r.steps)
    if n > 1:
        step = st.slider("Step", 1, n, 1, key=f"step_slider_{r.index}") - 1
    else:
        step = 0
        st.caption("One step.")
    st.markdown(
        f"**{literal(r.src)} → {literal(r.dst)}** — {r.bytes_per_rank:,.0f} bytes received per rank in all; "
        f"step {step + 1}: {literal(propagation.step_text(r.steps[step]))}"
    )
    _show(stepper.stepper_figure(plan, r, step))
    _downloads(
        lambda: stepper.stepper_figure(plan, r, step),
        lambda: stepper.stepper_text(plan, r, step),
        f"reshard-{r.index}-step{step + 1}",
        "stepper",
    )
    with st.expander("Each rank before and after (text)"):
        st.code(stepper.stepper_text(plan, r, step), language=None)


def view_comm(plan: Plan) -> None:
    _show(comm.comm_figure(plan))
    _downloads(lambda: comm.comm_figure(plan), lambda: comm.comm_text(plan), "communication", "comm")
    rows = comm.comm_table(plan)
    if rows:
        st.dataframe(arrow_safe(rows), hide_index=True)
    phase = st.radio("Traffic of", [ALL, "forward", "backward", "optimizer"], horizontal=True, key="traffic_phase")
    ph = None if phase == ALL else phase
    _show(comm.traffic_figure(plan, ph))
    _downloads(lambda: comm.traffic_figure(plan, ph), None, "traffic", "traffic")


@st.cache_resource(max_entries=32, show_spinner=False)
def _simulated(key: str, _plan: Plan, kind: str | None, microbatches: int | None) -> Timeline:
    del key
    return simulate_plan_lanes(_plan, kind, microbatches)


def _stage_table(plan: Plan, profile: HardwareProfile) -> list[dict[str, Any]]:
    """Per stage, milliseconds of one micro-batch on the chosen hardware (what the timeline is built from)."""
    prices = price_stages(plan, profile)
    rows = []
    for s in range(len(prices.forward)):
        rows.append(
            {
                "stage": s,
                "F ms": 1e3 * prices.forward[s],
                "B ms": 1e3 * (prices.backward[s] - prices.backward_weight[s]),
                "W ms": 1e3 * prices.backward_weight[s],
                "send F ms": 1e3 * prices.send_forward[s] if s < len(prices.send_forward) else 0.0,
                "send B ms": 1e3 * prices.send_backward[s - 1] if s > 0 else 0.0,
            }
        )
    return rows


def view_pipeline(
    plan: Plan,
    plan_key: str,
    main: Timeline | None,
    overlay: Timeline | None,
    hardware: str = AS_LOADED,
    profile: HardwareProfile | None = None,
) -> None:
    kinds = compatible_kinds(plan)
    if main is None and kinds:
        main = _simulated(plan_key, plan, None, None)
    if main is None:
        st.info(
            "This plan has no pipeline section and no timeline was loaded: nothing to draw. "
            "Load a timeline (mpipar.timeline JSON) in the sidebar."
        )
        return
    if overlay is not None and overlay.meta.get("source") == "measured":
        overlay = measured_on_lanes(overlay, main)
    unit = "s" if main.time_unit == "s" else " time units"
    c1, c2 = st.columns([1, 3])
    c1.metric("Predicted step", f"{main.makespan:.6g}{' ' if unit == 's' else ''}{unit}", border=True)
    if profile is not None:
        c2.caption(
            f"Priced on **{hardware}**: each op and reshard of the plan on the busiest rank of its stage "
            "(simulator.op_cost.PlanCosts), the schedule simulated with those stage times; the gradient "
            "sync and the optimizer once per step after the flush."
        )
    elif main.time_unit != "s":
        c2.caption(
            "This plan carries no costs: unit times (F 1, B 2). Pick a hardware preset in the sidebar for seconds."
        )
    else:
        c2.caption(f"Costs as loaded ({hardware}).")
    _show(timeline_view.timeline_figure(main, overlay))
    _downloads(
        lambda: timeline_view.timeline_figure(main, overlay),
        lambda: timeline_view.timeline_text(main),
        "timeline",
        "timeline",
    )
    st.download_button(
        "Chrome trace (Perfetto)",
        lambda: timeline_view.chrome_trace_bytes(main),
        "trace.json",
        "application/json",
        key="chrome",
        on_click="ignore",
    )
    if overlay is None:
        st.caption(
            'Load a measured timeline (meta.source = "measured", e.g. from MPIPAR_TRACE) to overlay it on '
            "the prediction."
        )
    elif "measured_ranks" in overlay.meta:
        st.caption(
            "Measured outlines: ranks "
            + literal(", ".join(str(r) for r in overlay.meta["measured_ranks"]))
            + " (the first rank of each stage mesh), from the measured file's first to last span."
        )
    st.dataframe(arrow_safe(timeline_view.bubble_rows(main)), hide_index=True)
    if profile is not None:
        st.dataframe(arrow_safe(_stage_table(plan, profile)), hide_index=True)
    if not kinds:
        return
    st.subheader("Two schedules side by side")
    c1, c2 = st.columns(2)
    current = plan_kind(plan)
    other_default = next((k for k in kinds if k != current), current)
    kind = c1.selectbox("Compare with schedule", kinds, index=kinds.index(other_default), key="pipe_kind")
    m = c2.number_input("micro-batches", 1, 256, plan_microbatches(plan), key="pipe_m")
    try:
        other = _simulated(plan_key, plan, kind, int(m))
    except (ValueError, NoPipeline) as exc:
        st.error(f"cannot build {literal(kind)} with {m} micro-batches: {literal(exc)}")
        return
    _show(timeline_view.side_by_side_figure(main, other))
    _downloads(lambda: timeline_view.side_by_side_figure(main, other), None, "schedules", "schedules")


def _capacity_choice(plan: Plan, profile: HardwareProfile | None = None) -> float | None:
    own = capacity_bytes(plan)
    options: dict[str, float | None] = {}
    if profile is not None and profile.memory_bytes:  # the hardware the plan is priced on comes first
        options[f"priced on: {profile.name} ({profile.memory_bytes / 2**30:.0f} GiB)"] = float(profile.memory_bytes)
    options[f"plan ({'none' if own is None else f'{own / 2**30:.0f} GiB'})"] = own
    for name in list_presets():
        cap = load_profile(name).memory_bytes
        if cap:
            options[f"{name} ({cap / 2**30:.0f} GiB)"] = float(cap)
    options["none"] = None
    label = st.selectbox("Device capacity line", list(options), key="mem_capacity")
    return options[label]


def view_memory(plan: Plan, plan_key: str, main: Timeline | None, profile: HardwareProfile | None = None) -> None:
    capacity = _capacity_choice(plan, profile)
    entries = [e["rank"] for e in (plan.memory or {}).get("ranks", []) if isinstance(e, dict)]
    curve = None
    title = None
    if entries:
        rank = st.selectbox("Rank", entries, key="mem_rank")
        curve = _rank_curve(plan_key, plan, int(rank))
        title = f"rank {rank} over the step ({plan_kind(plan)})"
        host = (rank_memory(plan, int(rank)) or {}).get(HOST_KEY)
        if isinstance(host, int | float) and host > 0:
            st.caption(
                f"Offloaded: {fmt_bytes(float(host))} of optimizer state in rank {rank}'s host memory "
                "(moved to the device for the update; not in the device curve below)."
            )
    elif main is not None and main.memory:
        lane = st.selectbox("Lane", sorted(main.memory), key="mem_lane")
        curve = main.memory[lane]
        title = f"lane {lane} over the step"
    if curve is None:
        st.info("No memory per rank in this plan or timeline.")
        return
    # A rank's curve is simulated from the plan (its costs' unit); a lane's comes from the loaded timeline.
    unit = plan_cost(plan).time_unit if entries else (main.time_unit if main else "s")
    _show(memory.memory_figure(curve, capacity, title, unit))
    _downloads(
        lambda: memory.memory_figure(curve, capacity, title, unit),
        lambda: memory.memory_text(curve, capacity),
        "memory",
        "memory",
    )
    if entries:
        peaks = _rank_peaks(plan_key, plan)
        _show(memory.peaks_figure(peaks, capacity))
        _downloads(lambda: memory.peaks_figure(peaks, capacity), None, "memory-peaks", "peaks")


@st.cache_resource(max_entries=64, show_spinner=False)
def _rank_curve(key: str, _plan: Plan, rank: int) -> Any:
    del key
    return memory.rank_curve(_plan, rank)


@st.cache_resource(max_entries=16, show_spinner=False)
def _rank_peaks(key: str, _plan: Plan) -> list[dict[str, Any]]:
    del key
    return memory.rank_peaks(_plan)


WHATIF_KINDS = ("FThenB", "1F1B", "Interleaved1F1B", "ZBH1")
_WHATIF_BOUNDS = {"dp": 64, "tp": 64, "pp": 16, "microbatches": 256, "hidden": 1 << 16, "batch": 1 << 16}


def _whatif_base(plan: Plan) -> tuple[SampleConfig, str | None]:
    """The sample configuration a sample plan's ``meta.config`` names, or the defaults and why.

    The plan may come from anywhere: its config is untrusted, so it is used only when it is a
    valid sample configuration within the widgets' bounds (a huge ``hidden`` would re-trace
    for ever, an unknown schedule would fail the selectbox).
    """
    config = plan.meta.get("config")
    if not isinstance(config, dict):
        return SampleConfig(), f"The plan's meta.config {config!r:.80} is not an object; using the sample's defaults."
    try:
        base = SampleConfig(**{k: v for k, v in config.items() if k in SampleConfig.__annotations__})
    except (TypeError, ValueError, KeyError) as exc:
        return SampleConfig(), f"The plan's meta.config is not a sample configuration ({exc}); using the defaults."
    for name, bound in _WHATIF_BOUNDS.items():
        if getattr(base, name) > bound:
            return SampleConfig(), (
                f"The plan's meta.config.{name} = {getattr(base, name)!r:.40} is over the what-if "
                f"limit of {bound}; using the sample's defaults."
            )
    if base.schedule not in WHATIF_KINDS:
        return SampleConfig(), f"The plan's schedule {base.schedule!r} has no what-if here; using the defaults."
    return base, None


def view_whatif(plan: Plan, plan_key: str, main: Timeline | None) -> None:
    """The sample re-traced with other knobs, or the plan's own script; then the strategy search."""
    _whatif_back_button()
    ref: script_whatif.ScriptRef | None = None
    if plan.meta.get("builder") == "viz.sample":
        _whatif_sample(plan, main)
    else:
        try:
            ref = script_whatif.script_ref(plan, _start_dir())
        except script_whatif.ScriptRefused as exc:
            # Another model's numbers would be wrong numbers: say why there are none.
            st.info(
                f"No what-if for this plan: {literal(exc)}. The what-if re-traces the plan's own script "
                "(`mpipar plan` records it); this plan's model cannot be re-traced here. The loaded plan:"
            )
            _loaded_metrics_table(_loaded_metrics(plan_key, plan))
        else:
            _whatif_script(plan, plan_key, ref)
    _whatif_search(plan, ref)


def _start_dir() -> str:
    """The directory the dashboard was started in: scripts outside it are never run."""
    return os.getcwd()


def _whatif_back_button() -> None:
    loaded = st.session_state.get("wi_loaded")
    if loaded is not None:
        st.info(f"The other views show the what-if plan **{literal(loaded['label'])}**.")
        if st.button(f"Back to {literal(loaded['base'])}", key="wi_back"):
            del st.session_state["wi_loaded"]
            st.rerun()


def whatif_loaded(
    source: str, plan: Plan, main_t: Timeline | None, overlay: Timeline | None
) -> tuple[str, Plan, Timeline | None, Timeline | None]:
    """The what-if plan the user loaded into the views, while the same file is open; else the inputs."""
    st.session_state["wi_source"] = source  # what a loaded what-if replaces, and what "Back" returns to
    loaded = st.session_state.get("wi_loaded")
    if loaded is None:
        return source, plan, main_t, overlay
    if loaded["base"] != source:  # another file was opened since: drop the what-if
        del st.session_state["wi_loaded"]
        return source, plan, main_t, overlay
    return loaded["label"], loaded["plan"], loaded["timeline"], None


def _load_into_views(label: str, plan: Plan, timeline: Timeline | None, key: str) -> None:
    if st.button("Load this plan into the other views", key=key):
        st.session_state["wi_loaded"] = {
            "base": st.session_state.get("wi_source", ""),
            "label": label,
            "plan": plan,
            "timeline": timeline,
        }
        st.rerun()


def _pipeline_timeline(plan: Plan) -> Timeline | None:
    """The plan's pipeline simulated with its own costs (unit costs without), or None without stages."""
    if not compatible_kinds(plan):
        return None
    try:
        return simulate_plan_lanes(plan, None, None)
    except (ValueError, NoPipeline):
        return None


def _knob_widgets(base: script_whatif.Knobs, prefix: str) -> script_whatif.Knobs:
    c = st.columns(4)
    dp = int(c[0].number_input("dp", 1, 64, base.dp, key=f"{prefix}_dp"))
    tp = int(c[1].number_input("tp", 1, 64, base.tp, key=f"{prefix}_tp"))
    pp = int(c[2].number_input("pp", 1, 16, base.pp, key=f"{prefix}_pp"))
    m = int(
        c[3].number_input("micro-batches (0: the script's default)", 0, 256, base.micro_batches or 0, key=f"{prefix}_m")
    )
    c = st.columns(5)
    schedules = ["(none: eager)", *script_whatif.SCHEDULES]
    kind = c[0].selectbox(
        "schedule", schedules, index=schedules.index(base.schedule or schedules[0]), key=f"{prefix}_kind"
    )
    chunks = int(c[1].number_input("chunks (Interleaved1F1B)", 1, 8, base.chunks, key=f"{prefix}_chunks"))
    zero = int(c[2].selectbox("ZeRO stage", script_whatif.ZERO_STAGES, index=base.zero, key=f"{prefix}_zero"))
    recompute = str(
        c[3].selectbox(
            "recompute",
            script_whatif.RECOMPUTES,
            index=script_whatif.RECOMPUTES.index(base.recompute),
            key=f"{prefix}_recompute",
        )
    )
    sp = bool(c[4].checkbox("sequence parallel", base.sequence_parallel, key=f"{prefix}_sp"))
    return script_whatif.Knobs(
        dp, tp, pp, None if kind == schedules[0] else kind, m or None, chunks, zero, recompute, sp
    )


def _confirmed_retrace(ref: script_whatif.ScriptRef, args: list[str], key: str) -> Plan | None:
    """Show the exact command; run it only when the user clicks (results kept per command)."""
    cmd = script_whatif.retrace_command(ref, args)
    st.code(script_whatif.command_text(cmd), language="bash")
    results: dict[tuple[str, ...], Plan] = st.session_state.setdefault("wi_results", {})
    if tuple(cmd) in results:
        return results[tuple(cmd)]
    st.caption("Re-tracing runs the script above on this machine: it runs only when you click.")
    if not st.button("Run this command", key=key):
        return None
    with st.spinner("re-tracing ..."):
        try:
            new_plan = script_whatif.retrace(ref, args)
        except (script_whatif.RetraceFailed, script_whatif.ScriptRefused) as exc:
            st.error(literal(exc))
            return None
    results[tuple(cmd)] = new_plan
    return new_plan


def _whatif_script(plan: Plan, plan_key: str, ref: script_whatif.ScriptRef) -> None:
    world = len(all_ranks(plan)) or 1
    try:
        base = script_whatif.read_knobs(ref.args, world)
    except script_whatif.ScriptRefused as exc:
        st.info(f"No what-if for this plan: {literal(exc)}.")
        return
    st.caption(
        f"Change the knobs: {literal(ref.recorded)} is re-traced with `mpipar plan`"
        f"{' --shape-only' if ref.shape_only else ''} and diffed against the loaded plan."
    )
    knobs = _knob_widgets(base, "wis")
    args = script_whatif.with_knobs(ref.args, base, knobs)
    loaded = _loaded_metrics(plan_key, plan)
    if args == list(ref.args):
        st.caption("These are the loaded plan's own arguments: change a knob to see a what-if. The loaded plan:")
        _loaded_metrics_table(loaded)
        return
    new_plan = _confirmed_retrace(ref, args, "wi_run")
    if new_plan is None:
        st.caption("The loaded plan (the what-if's column appears once the command has run):")
        _loaded_metrics_table(loaded)
        return
    new_plan = with_memory(new_plan)
    rows = whatif.diff_rows(loaded, whatif.plan_metrics(new_plan, _pipeline_timeline(new_plan)))
    st.dataframe(arrow_safe({k: v for k, v in r.items() if not k.startswith("_")} for r in rows), hide_index=True)
    _show(whatif.diff_figure(rows))
    _downloads(lambda: whatif.diff_figure(rows), lambda: whatif.diff_text(rows), "what-if", "whatif")
    st.download_button(
        "what-if plan (JSON)",
        lambda: _plan_json(new_plan),
        "whatif-plan.json",
        "application/json",
        key="wis-plan",
        on_click="ignore",
    )
    _load_into_views(" ".join([ref.recorded, *args]), new_plan, None, "wis_load")


@st.cache_resource(max_entries=16, show_spinner=False)
def _loaded_metrics(key: str, _plan: Plan) -> dict[str, Any]:
    """The loaded plan's what-if metrics (its pipeline simulated, its memory peaks): once per plan,
    not on every rerun a widget of the view triggers."""
    del key
    return whatif.plan_metrics(_plan, _pipeline_timeline(_plan))


def _loaded_metrics_table(metrics: dict[str, Any]) -> None:
    """The loaded plan's own numbers (what a what-if is compared with), before any re-trace."""
    rows = [{"metric": r["metric"], "loaded": r["loaded"]} for r in whatif.diff_rows(metrics, {})]
    st.dataframe(arrow_safe(rows), hide_index=True)


def _search_defaults(plan: Plan, ref: script_whatif.ScriptRef | None) -> search_view.SearchSpace:
    world = len(all_ranks(plan)) or 1
    presets = [p for p in list_presets() if load_profile(p).memory_bytes]
    hardware = "h100-nvlink-ib" if "h100-nvlink-ib" in presets or not presets else presets[0]  # search's default
    if ref is not None and os.path.basename(ref.path) == "gpt.py":
        return search_view.gpt_example_space(ref.args, min(world, search_view.MAX_DEVICES), hardware)
    return search_view.SearchSpace(4, 128, 4, 64, 128, min(world, search_view.MAX_DEVICES), 16, hardware)


def _whatif_search(plan: Plan, ref: script_whatif.ScriptRef | None) -> None:
    st.subheader("Strategy search")
    gpt = ref is not None and os.path.basename(ref.path) == "gpt.py"
    d = _search_defaults(plan, ref)
    st.caption(
        ("The model of the loaded `examples/gpt.py` plan" if gpt else "A GPT of the shape below")
        + ": every layout that divides is priced by the estimator; keep the space small to stay interactive."
    )
    c = st.columns(7)
    names = ("layers", "hidden", "heads", "seq", "vocab", "global_batch", "devices")
    vals = {
        n: int(
            c[i].number_input(
                n.replace("_", " "), 1, search_view.BOUNDS[n], min(getattr(d, n), search_view.BOUNDS[n]), key=f"wss_{n}"
            )
        )
        for i, n in enumerate(names)
    }
    c = st.columns(4)
    presets = [p for p in list_presets() if load_profile(p).memory_bytes]
    hardware = c[0].selectbox(
        "hardware", presets, index=presets.index(d.hardware) if d.hardware in presets else 0, key="wss_hw"
    )
    limit_mib = int(c[1].number_input("memory limit MiB (0: the device's)", 0, 1 << 30, 0, key="wss_limit"))
    sample = ref is None and plan.meta.get("builder") == "viz.sample"
    zeros = [z for z in script_whatif.ZERO_STAGES if not (sample and z == 3)]  # the sample has no ZeRO-3
    zero = tuple(c[2].multiselect("ZeRO stages", zeros, [0], key="wss_zero"))
    recompute = tuple(c[3].multiselect("recompute", script_whatif.RECOMPUTES, ["none"], key="wss_recompute"))
    schedules = tuple(st.multiselect("schedules (pipelines)", script_whatif.SCHEDULES, ["1F1B"], key="wss_sched"))
    space = search_view.SearchSpace(
        vals["layers"],
        vals["hidden"],
        vals["heads"],
        vals["seq"],
        vals["vocab"],
        vals["devices"],
        vals["global_batch"],
        str(hardware),
        limit_mib * 2**20 if limit_mib else None,
        zero,
        recompute,
        schedules,
        dropout=d.dropout,
    )
    if st.button("Search", key="wss_go"):
        st.session_state["wss_space"] = space
    asked = st.session_state.get("wss_space")
    if asked is None:
        return
    if asked != space:
        st.caption("The fields changed since the last search: click Search to run it on them.")
    try:
        with st.spinner("searching ..."):
            result = search_view.run_search(asked)
    except ValueError as exc:
        st.error(f"cannot search: {literal(exc)}")
        return
    points = search_view.candidates(result)
    front = search_view.pareto_front(points)
    st.caption(
        f"{len(points)} candidates priced in {result.seconds:.1f} s ({result.enumerated} enumerated; pruned: "
        + (", ".join(f"{v} {k}" for k, v in result.pruned.items()) or "none")
        + f"); {len(front)} on the Pareto front."
    )
    if not points:
        st.info("No candidate divides this model and device count.")
        return
    chosen = st.selectbox(
        "Candidate",
        list(range(len(points))),
        key="wss_cand",
        format_func=lambda i: ("* " if i in front else "") + search_view.candidate_label(points[i]),
    )
    _show(search_view.search_figure(points, front, result.memory_limit, chosen))
    _downloads(
        lambda: search_view.search_figure(points, front, result.memory_limit, chosen),
        lambda: search_view.search_text(points, front, result.memory_limit),
        "search",
        "search",
    )
    with st.expander("All candidates"):
        st.dataframe(arrow_safe(search_view.candidate_rows(points, front)), hide_index=True)
    _load_candidate(plan, ref, points[int(chosen)])


def _load_candidate(plan: Plan, ref: script_whatif.ScriptRef | None, cand: search_view.Candidate) -> None:
    label = search_view.candidate_label(cand)
    if ref is not None:
        try:
            base = script_whatif.read_knobs(ref.args, len(all_ranks(plan)))
        except script_whatif.ScriptRefused as exc:
            st.info(f"This candidate cannot be re-traced: {literal(exc)}.")
            return
        flags = search_view.candidate_flags(cand, scheduled=base.schedule is not None)
        args = script_whatif.with_knobs(ref.args, base, script_whatif.Knobs(**flags))
        st.markdown("Re-trace the loaded plan's script with this candidate's flags:")
        new_plan = _confirmed_retrace(ref, args, "wss_run")
        if new_plan is not None:
            _load_into_views(" ".join([ref.recorded, *args]), with_memory(new_plan), None, "wss_load")
        return
    if plan.meta.get("builder") == "viz.sample":
        flags = search_view.candidate_flags(cand, scheduled=True)
        base_cfg, _ = _whatif_base(plan)
        kind = flags["schedule"] or base_cfg.schedule
        try:
            new_plan, new_t = whatif.whatif_sample(
                flags["dp"],
                flags["tp"],
                flags["pp"],
                kind,
                flags["micro_batches"],
                flags["zero"],
                flags["recompute"],
                base_cfg.hidden,
                base_cfg.batch,
                base_cfg.profile,
            )
        except ValueError as exc:
            st.info(f"The sample cannot take this candidate: {literal(exc)}")
            return
        _load_into_views(f"sample what-if ({label})", new_plan, new_t, "wss_load")
        return
    st.info("This plan records no script to re-trace with the candidate's flags, so no plan can be loaded for it.")


def _whatif_sample(plan: Plan, main: Timeline | None) -> None:
    base, note = _whatif_base(plan)
    if note:
        st.warning(literal(note))
    st.caption("Change the knobs: the sample is re-traced in shape-only mode and re-simulated (cached).")
    c = st.columns(4)
    dp = c[0].number_input("dp", 1, 64, base.dp, key="wi_dp")
    tp = c[1].number_input("tp", 1, 64, base.tp, key="wi_tp")
    pp = c[2].number_input("pp", 1, 16, base.pp, key="wi_pp")
    m = c[3].number_input("micro-batches", 1, 256, base.microbatches, key="wi_m")
    c = st.columns(4)
    kind = c[0].selectbox("schedule", WHATIF_KINDS, index=WHATIF_KINDS.index(base.schedule), key="wi_kind")
    offered = [z for z in ZERO_STAGES if f"zero={z}" not in UNSUPPORTED]
    zero = c[1].selectbox(
        "ZeRO stage",
        offered,
        index=offered.index(base.zero) if base.zero in offered else 0,
        key="wi_zero",
        help=f"ZeRO-3 is not offered: {UNSUPPORTED['zero=3']}",
    )
    recompute = c[2].selectbox(
        "recompute", RECOMPUTE_MODES, index=RECOMPUTE_MODES.index(base.recompute), key="wi_recompute"
    )
    presets = list_presets()
    profile = c[3].selectbox(
        "hardware", presets, index=presets.index(base.profile) if base.profile in presets else 0, key="wi_profile"
    )
    st.caption(f"ZeRO-3 is not offered: {UNSUPPORTED['zero=3']}.")
    try:
        new_plan, new_t = whatif.whatif_sample(
            int(dp), int(tp), int(pp), kind, int(m), int(zero), str(recompute), base.hidden, base.batch, profile
        )
    except ValueError as exc:
        st.error(f"cannot build this what-if: {literal(exc)}")
        return
    rows = whatif.diff_rows(whatif.plan_metrics(plan, main), whatif.plan_metrics(new_plan, new_t))
    st.dataframe(arrow_safe({k: v for k, v in r.items() if not k.startswith("_")} for r in rows), hide_index=True)
    _show(whatif.diff_figure(rows))
    _downloads(lambda: whatif.diff_figure(rows), lambda: whatif.diff_text(rows), "what-if", "whatif")
    with st.expander("What-if pipeline timeline"):
        _show(timeline_view.timeline_figure(new_t))
    st.download_button(
        "what-if plan (JSON)",
        lambda: _plan_json(new_plan),
        "whatif-plan.json",
        "application/json",
        key="wi-plan",
        on_click="ignore",
    )
    _load_into_views(
        f"sample what-if (dp={dp},tp={tp},pp={pp} {kind} x{m}, ZeRO {zero}, recompute {recompute})",
        new_plan,
        new_t,
        "wi_load",
    )


def _plan_json(plan: Plan) -> bytes:
    import json

    return json.dumps(plan.to_dict()).encode()


# ------------------------------------------------------------------------------ page
def _sample_knobs() -> None:
    with st.sidebar.expander("Built-in sample", expanded=False):
        c = st.columns(2)
        dp = c[0].number_input("dp", 1, 8, 2, key="s_dp")
        tp = c[1].number_input("tp", 1, 8, 2, key="s_tp")
        pp = c[0].number_input("pp", 1, 8, 2, key="s_pp")
        m = c[1].number_input("micro-batches", 1, 64, 4, key="s_m")
        kind = st.selectbox("schedule", ["1F1B", "FThenB", "Interleaved1F1B", "ZBH1"], key="s_kind")
        st.session_state["sample_knobs"] = (int(dp), int(tp), int(pp), kind, int(m))


def _own_costs(plan: Plan, main_t: Timeline | None) -> str | None:
    """What "as loaded" means for this plan: its own pipeline costs' profile, or a loaded timeline."""
    cost = (plan.pipeline or {}).get("cost")
    if isinstance(cost, dict) and "forward" in cost:
        return str(cost.get("profile") or cost.get("time_unit", "plan costs"))
    if main_t is not None:
        return "the loaded timeline"
    return None


@st.cache_resource(max_entries=8, show_spinner=False)
def _preset(name: str) -> HardwareProfile:
    return load_profile(name)


@st.cache_resource(max_entries=8, show_spinner=False)
def _uploaded_profile(digest: str, name: str, _data: bytes) -> HardwareProfile:
    del digest
    return profile_from_bytes(_data, name)


def _hardware(plan: Plan, main_t: Timeline | None) -> tuple[str, str, HardwareProfile | None]:
    """The sidebar's hardware selector: (label, cache key, profile); profile None keeps the plan's own costs."""
    own = _own_costs(plan, main_t)
    presets = list_presets()
    options = ([f"{AS_LOADED} ({own})"] if own else []) + presets + [PROFILE_FILE]
    default = 0 if own else presets.index(DEFAULT_PRESET) if DEFAULT_PRESET in presets else 0
    choice = st.sidebar.selectbox(
        "Hardware (prices the plan)",
        options,
        index=default,
        key="hw",
        help="prices every op and reshard of the plan with the simulator's cost model on this hardware: the "
        "pipeline and memory views are then in seconds. A calibrated profile comes from "
        "`python -m simulator calibrate -o profile.json`.",
    )
    if choice.startswith(AS_LOADED):
        return choice, "own", None
    if choice != PROFILE_FILE:
        return choice, f"preset:{choice}", _preset(choice)
    up = st.sidebar.file_uploader("Profile JSON", type=["json"], key="hw_upload")
    path = st.sidebar.text_input("or its path", key="hw_path", placeholder="profile.json")
    try:
        if up is not None:
            data = up.getvalue()
            digest = hashlib.sha256(data).hexdigest()
            return f"{up.name}", f"upload:{digest}", _uploaded_profile(digest, up.name, data)
        if path.strip():
            profile = profile_from_path(path)
            return path.strip(), f"path:{os.path.abspath(path.strip())}:{hash(repr(profile.to_dict()))}", profile
    except ProfileError as exc:
        st.sidebar.error(literal(exc), icon="🚫")
    fallback = own or DEFAULT_PRESET
    st.sidebar.caption(f"No profile loaded yet: prices as {literal(fallback)}.")
    if own:
        return f"{AS_LOADED} ({own})", "own", None
    return DEFAULT_PRESET, f"preset:{DEFAULT_PRESET}", _preset(DEFAULT_PRESET)


@st.cache_resource(max_entries=16, show_spinner=False)
def _with_memory(key: str, _plan: Plan) -> Plan:
    del key
    return with_memory(_plan)


@st.cache_resource(max_entries=16, show_spinner="Pricing the plan...")
def _priced(key: str, _plan: Plan, _profile: HardwareProfile) -> Plan:
    del key
    # an eager plan gains a one-stage pipeline section when priced: its memory can then be derived too
    return with_memory(priced(_plan, _profile))


def main() -> None:
    st.set_page_config(page_title="mpipar dashboard", layout="wide")
    st.sidebar.title("mpipar")
    _sample_knobs()
    key, source, plan, main_t, overlay = _load_inputs()
    loaded_source, plan, main_t, overlay = whatif_loaded(source, plan, main_t, overlay)  # a what-if the user loaded
    if loaded_source != source:  # a different plan than the file's: its own cache key
        key, source = f"{key}|what-if:{loaded_source}:{id(plan)}", loaded_source
    # mpipar plan writes no memory section: derive it from the plan's own tensors
    plan = _with_memory(key, plan)
    hardware, hw_key, profile = _hardware(plan, main_t)
    plan_key = f"{key}|{hw_key}"
    timed, timed_t = plan, main_t
    if profile is not None and plan.meshes:
        try:
            timed, timed_t = _priced(plan_key, plan, profile), None  # the priced plan is simulated
        except ValueError as exc:
            st.error(f"cannot price this plan on {literal(hardware)}: {literal(exc)}")
    st.sidebar.caption(f"Plan: **{literal(source)}**")
    st.sidebar.text(literal(plan.summary(), markdown=False))
    view = st.radio("View", VIEWS, horizontal=True, key="view", label_visibility="collapsed")
    st.header(view)
    if view == "Layout":
        view_layout(plan)
    elif view == "Propagation":
        view_propagation(plan)
    elif view == "Reshard stepper":
        view_stepper(plan)
    elif view == "Communication":
        view_comm(plan)
    elif view == "Pipeline":
        view_pipeline(timed, plan_key, timed_t, overlay, hardware, profile if timed is not plan else None)
    elif view == "Memory":
        view_memory(timed, plan_key, timed_t, profile if timed is not plan else None)
    else:
        view_whatif(plan, plan_key, main_t)


main()
