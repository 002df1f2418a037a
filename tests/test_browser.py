"""The course where its readers meet it: JupyterLab in a real browser.

JupyterLab starts as `make lab` starts it (127.0.0.1, a token), headless Chromium opens chapter 03,
runs every cell from the Run menu, drags the KV-memory calculator's context slider, and checks that
the widget redrew: its summary and its plot change, as a reader would see. Then the saved chapter
becomes a site page (tools/build_site.py) showing the widget as last drawn, and a chapter built as
`make site` builds it opens from disk with every plot decoded. Screenshots go to build/browser/
(ignored by git).

The browser is Debian's Chromium driven through Playwright's Python API; nothing is downloaded at
run time (never `playwright install`). Without Chromium the test is skipped with the command that
installs it; `.ci/run` installs it and sets MINI_ENGINE_REQUIRE_BROWSER=1, so in CI it must run.
Chapter 03 runs a torch.compile cell (about a minute on a 2-core CPU): the timeouts are generous.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tools import build_site

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "build" / "browser"
CHROMIUM = "/usr/bin/chromium"
INSTALL = "apt-get update && apt-get install -y chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
CHAPTER = "03_kv_cache.ipynb"
RUN_ALL_TIMEOUT_S = 900

pytestmark = pytest.mark.slow


def _missing(what: str):
    if os.environ.get("MINI_ENGINE_REQUIRE_BROWSER"):
        pytest.fail(f"{what} (MINI_ENGINE_REQUIRE_BROWSER is set: this run must test the browser)", pytrace=False)
    pytest.skip(what)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        _missing(f"Chromium is not installed; install it with: {INSTALL}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright is not installed; install it with: .venv/bin/python -m pip install -e '.[dev]'")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab over a scratch copy of the chapter (running it saves outputs, which must not land in
    the checkout), with its own config, workspace and settings folders; yields (base URL, token)."""
    base = tmp_path_factory.mktemp("jupyterlab")
    (base / "chapters").mkdir()
    shutil.copy(ROOT / "chapters" / CHAPTER, base / "chapters" / CHAPTER)
    settings = base / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Every cell in the page, not only those scrolled into view, so the test can find the widget.
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # Saving keeps the widgets' state, as `make site` does, so the saved chapter renders them.
    widgets = base / "settings" / "@jupyter-widgets" / "jupyterlab-manager"
    widgets.mkdir(parents=True)
    (widgets / "plugin.jupyterlab-settings").write_text(json.dumps({"saveState": True}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel draws inline, as in make lab
    env.update(JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_RUNTIME_DIR=str(base / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"), JUPYTERLAB_SETTINGS_DIR=str(base / "settings"))
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={base}", "--LabApp.default_url=/lab/tree/chapters",
           "--LabApp.expose_app_in_browser=True"]
    if os.getuid() == 0:
        cmd.append("--allow-root")  # as make lab does in a container
    log = open(base / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, cwd=base, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start:\n{(base / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, token, base
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# The notebook as JupyterLab holds it: code cells still to run, cells running, errors, kernel status.
STATE_JS = """() => {
  if (!window.jupyterapp) return null;
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.content.model) return null;
  const cells = panel.content.model.cells, kernel = panel.sessionContext.session?.kernel;
  let code = 0, pending = 0, errors = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    code++;
    if (cell.executionCount === null) pending++;
    for (const out of cell.outputs.toJSON()) {
      if (out.output_type === 'error') errors.push(`cell ${i}: ${out.ename}: ${out.evalue}`);
    }
  }
  const running = document.querySelectorAll('.jp-InputPrompt').length
      ? [...document.querySelectorAll('.jp-InputPrompt')].filter(p => p.textContent.includes('*')).length : 0;
  return {code, pending, running, errors, kernel: kernel ? kernel.status : null};
}"""


def _wait_for(page, predicate, timeout_s: float, what: str, interval_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = page.evaluate(STATE_JS)
        if state and state["errors"]:
            pytest.fail(f"chapter 03 raised in the browser: {state['errors']}", pytrace=False)
        if state and predicate(state):
            return state
        time.sleep(interval_s)
    page.screenshot(path=SHOTS / "timeout.png")
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last state {state} "
                f"(screenshot: {SHOTS / 'timeout.png'})", pytrace=False)


def _widget_view(page):
    """The KV-memory calculator's summary text and plot image, as the page shows them."""
    widget = page.locator(".widget-vbox", has=page.locator(".widget-slider", has_text="context")).last
    summary = widget.locator(".widget-html-content").first.inner_text()
    image = widget.locator("img").first.get_attribute("src")
    readout = widget.locator(".widget-slider", has_text="context").locator(".widget-readout").first.inner_text()
    return widget, summary, image, readout


def test_chapter_03_runs_in_jupyterlab_and_its_slider_redraws(browser, jupyterlab):
    url, token, base = jupyterlab
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    page.goto(f"{url}/lab/tree/chapters/{CHAPTER}?token={token}", timeout=120_000)
    _wait_for(page, lambda s: s["kernel"] == "idle" and s["code"] > 0, 180, "the notebook to open with an idle kernel")
    page.screenshot(path=SHOTS / "03_opened.png")

    start = time.monotonic()
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    state = _wait_for(page, lambda s: s["pending"] == 0 and s["running"] == 0 and s["kernel"] == "idle",
                      RUN_ALL_TIMEOUT_S, "Run All Cells to finish", interval_s=5)
    print(f"chapter 03: {state['code']} code cells ran in {time.monotonic() - start:.0f} s in the browser")

    widget, summary, image, readout = _widget_view(page)
    widget.scroll_into_view_if_needed()
    widget.screenshot(path=SHOTS / "03_kv_widget_before.png")
    assert image and summary, "the KV-memory widget shows no plot or no summary after Run All"

    handle = widget.locator(".widget-slider", has_text="context").locator(".noUi-handle").first
    box = handle.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2 + 120, box["y"] + box["height"] / 2, steps=10)
    page.mouse.up()

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _, summary_after, image_after, readout_after = _widget_view(page)
        if summary_after != summary and image_after != image:
            break
        time.sleep(0.5)
    widget.screenshot(path=SHOTS / "03_kv_widget_after.png")
    page.screenshot(path=SHOTS / "03_after.png")
    assert readout_after != readout, f"dragging the context slider did not move it (still {readout})"
    assert summary_after != summary, f"the summary did not change when context went {readout} -> {readout_after}"
    assert image_after != image, f"the plot was not redrawn when context went {readout} -> {readout_after}"

    # Saved from JupyterLab, the chapter renders as a site page (tools/build_site.py, as make site
    # does after executing it) with the widget as it was last drawn: the moved slider's value.
    saved = base / "chapters" / CHAPTER
    before_save = saved.stat().st_mtime
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 60
    while saved.stat().st_mtime == before_save and time.monotonic() < deadline:
        time.sleep(0.5)
    nb = nbformat.read(saved, as_version=4)
    html_page = build_site.write_page(nb, base / "site" / CHAPTER.replace(".ipynb", ".html"))
    page.goto(html_page.as_uri(), wait_until="domcontentloaded")
    loaded = _loaded_images(page)
    page.screenshot(path=SHOTS / "03_site_page.png", full_page=True)
    assert any(img["alt"] == "widget plot" for img in loaded), (
        f"the site page shows no drawing of the KV-memory widget: images {[i['alt'] for i in loaded]}")
    assert readout_after in page.inner_text("body"), f"the site page lost the slider's last value {readout_after}"
    page.close()


def _loaded_images(page) -> list[dict]:
    """The page's images that the browser decoded (a broken image has naturalWidth 0)."""
    page.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=60_000)
    return page.evaluate("""() => [...document.images].map(i => ({alt: i.alt, src: i.src.slice(0, 22),
                                                                  width: i.naturalWidth}))
                                  .filter(i => i.width > 0)""")


def test_a_chapter_built_by_make_site_shows_its_plots(browser, tmp_path):
    """`make site` for one chapter (00, the quickest), opened from disk: every plot it drew is there."""
    written = build_site.build(["00"], out_dir=tmp_path / "site")
    page_path, index = written[0], written[-1]
    executed_pngs = len(re.findall(r'<img[^>]*src="data:image/png', page_path.read_text()))
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(index.as_uri(), wait_until="domcontentloaded")
    page.click(f"a[href='{page_path.name}']")
    page.wait_for_load_state("domcontentloaded")
    assert "Setup and the model" in page.title(), f"the index should link chapter 00, not {page.title()!r}"
    plots = [img for img in _loaded_images(page) if img["src"].startswith("data:image/png")]
    page.screenshot(path=SHOTS / "00_site_page.png", full_page=True)
    assert len(plots) >= 2 and len(plots) == executed_pngs, (
        f"chapter 00's page should show its {executed_pngs} plots (at least 2); the browser decoded {len(plots)}")
    page.close()
