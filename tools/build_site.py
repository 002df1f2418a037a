"""Build the course as a static site: every chapter executed, with its outputs, as one HTML page.

    python tools/build_site.py                 # every chapter -> build/site/ (make site)
    python tools/build_site.py 00 03           # only these chapters (the index lists those built)
    python tools/build_site.py --out DIR ...

Each committed chapter notebook (outputs stripped) is run top to bottom in a fresh kernel from
chapters/, as nbval runs it, then rendered with nbconvert's JupyterLab template: text, tables and
plots (PNG, embedded in the page) as the reader saw them, readable without Jupyter. Sliders need a
kernel, so a page shows each widget as it was last drawn (its text and plot, its controls' values),
not live. build/site/index.html is the course map. CSS and images are inlined; MathJax (for TeX in
the text) is the one thing a browser fetches, and a page reads the same without it.
"""
from __future__ import annotations

import argparse
import html
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "site"


def chapters(root: Path = ROOT, only: list[str] | None = None) -> list[Path]:
    found = sorted((root / "chapters").glob("[0-9A][0-9]_*.ipynb"))
    return [p for p in found if not only or p.name[:2] in only]


def title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "untitled"


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run a chapter as a reader would: a fresh kernel in chapters/, every cell in order."""
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # plots inline, as in JupyterLab
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
    return nb


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _widget_html(models: dict, model_id: str) -> str:
    """A widget as it was last drawn, in plain HTML: boxes lay out their children, HTML and Image
    widgets show their content, controls show their label and value (they cannot move without a kernel)."""
    model = models.get(model_id)
    if model is None:
        return ""
    state, name = model["state"], model["model_name"]
    child = lambda ref: _widget_html(models, ref.removeprefix("IPY_MODEL_"))
    if name in ("VBoxModel", "BoxModel", "HBoxModel", "GridBoxModel"):
        flow = "column" if name == "VBoxModel" else "row"
        inner = "".join(child(c) for c in state.get("children", []))
        return f'<div style="display:flex;flex-flow:{flow} wrap;gap:0.3em 1.5em">{inner}</div>'
    if name in ("HTMLModel", "HTMLMathModel"):
        return f"<div>{state.get('value', '')}</div>"
    if name == "ImageModel":
        data = next((b["data"] for b in model.get("buffers", []) if b.get("path") == ["value"]), None)
        fmt = state.get("format", "png")
        return f'<img alt="widget plot" src="data:image/{fmt};base64,{data}">' if data else ""
    if name == "OutputModel":
        return ""  # a widget's error area; empty when it drew without errors
    if "value" in state or "index" in state:
        value = state.get("value")
        if value is None and "index" in state and state.get("_options_labels"):
            value = state["_options_labels"][state["index"]]
        label = html.escape(str(state.get("description", "")))
        return f"<span><b>{label}</b> {html.escape(str(value))}</span>"
    return ""


def static_widgets(nb: nbformat.NotebookNode) -> int:
    """Replace each live widget output by its last drawing, from the widget state that execution
    stored; the page then needs no widget JavaScript (from a CDN) to show it. Returns how many."""
    models = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    count = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view:
                note = ('<p style="font-size:85%;color:#666">An interactive widget, shown as it was drawn: '
                        "open the notebook to move its controls.</p>")
                out["data"] = {"text/html": _widget_html(models, view["model_id"]) + note}
                count += 1
    nb.metadata.pop("widgets", None)
    return count


def write_page(nb: nbformat.NotebookNode, out: Path) -> Path:
    """Render an executed notebook as a standalone HTML page (inline CSS, plots as data: URIs)."""
    static_widgets(nb)
    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title(nb)}})
    # require.js serves live widgets and JavaScript outputs, neither of which a static page has.
    body = body.replace(f'<script src="{exporter.require_js_url}"></script>', "")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body, encoding="utf-8")
    return out


def write_index(pages: list[tuple[str, str]], out_dir: Path) -> Path:
    items = "\n".join(f'  <li><a href="{html.escape(href)}">{html.escape(name)}</a></li>' for href, name in pages)
    index = out_dir / "index.html"
    index.write_text(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mini-engine: LLM inference optimisation, measured</title>
<style>body {{ font-family: sans-serif; max-width: 48em; margin: 2em auto; line-height: 1.5 }}</style></head>
<body>
<h1>mini-engine: LLM inference optimisation, measured</h1>
<p>Each chapter as it ran when this site was built (on {html.escape(sys.platform)}, {time.strftime('%Y-%m-%d')}):
text, tables and plots. Open the notebooks in JupyterLab or on Colab to run them and move the sliders.</p>
<ol start="0">
{items}
</ol>
</body></html>
""", encoding="utf-8")
    return index


def build(only: list[str] | None = None, out_dir: Path = OUT, root: Path = ROOT) -> list[Path]:
    pages, written = [], []
    for path in chapters(root, only):
        start = time.perf_counter()
        nb = execute(path)
        page = write_page(nb, out_dir / path.with_suffix(".html").name)
        print(f"{page.relative_to(out_dir.parent) if out_dir.parent in page.parents else page}: "
              f"{time.perf_counter() - start:.0f} s")
        pages.append((page.name, title(nb)))
        written.append(page)
    written.append(write_index(pages, out_dir))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="chapter numbers to build (default: all)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default: {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if not chapters(ROOT, args.only):
        print(f"no chapter matches {args.only}")
        return 1
    build(args.only, args.out)
    print(f"open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
