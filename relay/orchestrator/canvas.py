"""The figures the flow draws again and again (the curves at each of a session's events, the timeline at each
hand-over), made once per thread and kind and cleared for each drawing.

A new matplotlib figure makes its Axes and every tick (five artists each) anew. A cleared figure keeps its tick
objects; their texts and positions are set at each draw anyway, and their style is ours, the same at every
drawing: a curves figure and a timeline cost ~22 % less CPU than on new figures (docs/benchmarks.md). The pixels
are a new figure's (tests/orchestrator/test_report.py compares them).
Made without pyplot: a figure no pyplot call can reach is its thread's alone, so flows in threads never share one.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Tuple

_HELD = threading.local()  # kind -> (figure, axes) of this thread
_SUBPLOT_PARAMS = ("left", "right", "bottom", "top", "wspace", "hspace")


def figure(kind: str, size: Tuple[float, float], dpi: float, make_axes: Callable) -> Tuple[object, List]:
    """(figure, axes) of `kind`, `size` inches at `dpi`: `make_axes(figure)` on a new figure the first time in this
    thread, then the same figure and axes cleared as new: limits, scales, locators, labels, margins (tick objects
    kept)."""
    import matplotlib as mpl
    from matplotlib.transforms import Bbox

    held = getattr(_HELD, kind, None)
    if held is None or held[0].dpi != dpi:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=size, dpi=dpi)
        FigureCanvasAgg(fig)
        held = (fig, list(make_axes(fig)))
        setattr(_HELD, kind, held)
        return held
    fig, axes = held
    fig.set_size_inches(size)
    fig.subplots_adjust(**{k: mpl.rcParams[f"figure.subplot.{k}"] for k in _SUBPLOT_PARAMS})
    if fig._suptitle is not None:  # noqa: SLF001 - a figure's title, made again by a drawing that has one
        fig._suptitle.remove()  # noqa: SLF001
        fig._suptitle = None  # noqa: SLF001
    for ax in axes:
        kept = (ax.xaxis.majorTicks, ax.yaxis.majorTicks)
        ax.cla()
        ax.xaxis.majorTicks, ax.yaxis.majorTicks = kept
        ax.dataLim.set(Bbox.null())  # cla keeps it: an Axes that draws no data would widen its shared axis
    for ax in axes:
        if len(ax.get_shared_x_axes().get_siblings(ax)) > 1:
            ax.label_outer()  # as Figure.subplots(sharex=True) leaves them: x tick labels on the bottom Axes only
    return held
