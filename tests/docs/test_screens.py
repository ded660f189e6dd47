"""Every page of the documentation site as a reader sees it, in a real headless browser (Debian's
chromium, driven through chromedriver by selenium) with a 1280x900 window, over http from a
local server. For each page (every index.html of the site that tests/docs/conftest.py builds
once for the docs tests):

- a screenshot is taken (saved in the test's tmp dir) and must not be blank: the text column
  shows more than a few colours;
- nothing is cut off or needs scrolling sideways at 1280 px: the page is no wider than the
  window, and every table, every table cell and every image ends inside the window and inside
  any box that would clip or scroll it (the theme wraps each table in one). This is what caught
  the Accelerate/Fabric table of runtime.md, whose ddpkit column was off-screen before
  docs/css/tables.css let cells wrap: without that file the check names the table and the column;
- code is highlighted: on a page with highlighted blocks, keywords (`.kn`) and the other tokens
  show in colours of their own, not the plain text's (docs/css/pygments.css);
- the page reads offline: every request goes to the local server (the browser cannot resolve
  any other host) and none fails, and the page logs no error.

A failure names the page, its source file and what is wrong. The last test shows the checks can
fail: a small page with a 3000 px table, an unhighlighted keyword and a request to another host
is reported for each.

Needs /usr/bin/chromium and /usr/bin/chromedriver (`apt-get install -y chromium chromium-driver`,
which .ci/run does): without them the tests skip, or fail under CI (CI set)."""

from __future__ import annotations

import functools
import io
import json
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image  # Pillow comes with matplotlib, a dependency of ddpkit

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
APT = "apt-get install -y chromium chromium-driver"
WIDTH, HEIGHT = 1280, 900
SIDEBAR = 300  # the theme's navigation column: the text column starts to its right

pytestmark = pytest.mark.cli  # a subprocess: the browser (and the mkdocs build)

# What overflows at 1280 px: a list of sentences, empty when all is readable without scrolling.
LAYOUT_JS = r"""
const vw = document.documentElement.clientWidth;  // the window less its scrollbar
const problems = [];
const text = (el) => el.textContent.replace(/\s+/g, " ").replace(/¶$/, "").trim().slice(0, 40);
const headings = Array.from(document.querySelectorAll("h1, h2, h3, h4"));
const where = (el) => {
  let last = null;
  for (const h of headings) if (h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING) last = h;
  return last ? ` under '${text(last)}'` : "";
};
const clippers = (el) => {  // el and the boxes around it that clip or scroll what is wider than they are
  const out = [];
  for (let a = el; a && a !== document.body && a !== document.documentElement; a = a.parentElement)
    if (getComputedStyle(a).overflowX !== "visible") out.push(a);
  return out;
};
const limit = (boxes) => Math.min(vw, ...boxes.map((b) => b.getBoundingClientRect().left + b.clientLeft + b.clientWidth));
const page = document.documentElement.scrollWidth;
if (page > vw + 1) problems.push(`the page is ${page} px wide in a ${vw} px window: it scrolls sideways`);
document.querySelectorAll("table").forEach((table, i) => {
  const head = table.rows.length ? Array.from(table.rows[0].cells).map(text) : [];
  const name = `table ${i + 1}${where(table)} (${head.join(" | ")})`;
  const right = table.getBoundingClientRect().right;
  if (right > vw + 1) problems.push(`${name} ends at x=${Math.round(right)}, past the ${vw} px window`);
  const boxes = clippers(table);
  for (const b of boxes)
    if (b.scrollWidth > b.clientWidth + 1)
      problems.push(
        `${name} needs ${b === table ? "scrolling" : `its box (${b.className || b.tagName}) scrolled`} sideways:` +
          ` ${b.scrollWidth} px in ${b.clientWidth}`,
      );
  const edge = limit(boxes);
  cells: for (const row of table.rows)
    for (const cell of row.cells) {
      const end = cell.getBoundingClientRect().right;
      if (end > edge + 1) {
        const column = head[cell.cellIndex] ?? "";
        problems.push(`${name}: column ${cell.cellIndex + 1} ('${column}') ends at x=${Math.round(end)}, past x=${Math.round(edge)}, where it is cut off`);
        break cells;
      }
    }
});
document.querySelectorAll("img").forEach((img) => {
  const end = img.getBoundingClientRect().right;
  if (end > limit(clippers(img)) + 1) problems.push(`image ${img.getAttribute("src")}${where(img)} ends at x=${Math.round(end)}, past the window`);
});
return problems;
"""

# The computed colours of highlighted code: null on a page without highlighted blocks.
COLOURS_JS = r"""
const blocks = document.querySelectorAll(".codehilite");
if (!blocks.length) return null;
const plain = getComputedStyle(blocks[0].querySelector("code") || blocks[0]).color;
const kn = document.querySelector(".codehilite .kn");
const tokens = Array.from(document.querySelectorAll(".codehilite span[class]")).filter((s) => s.className !== "w");
const coloured = tokens.filter((s) => getComputedStyle(s).color !== plain).length;
return {plain: plain, kn: kn && getComputedStyle(kn).color, tokens: tokens.length, coloured: coloured};
"""

WAIT_FOR_FONTS_JS = "const done = arguments[arguments.length - 1]; document.fonts.ready.then(() => done(true));"


def _need_browser() -> None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing and os.environ.get("CI"):
        pytest.fail(f"{' and '.join(missing)} missing: .ci/run should have installed it ({APT})", pytrace=False)
    if missing:
        pytest.skip(f"no headless browser ({' and '.join(missing)} missing): {APT}")


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for every page, its viewport 1280x900, unable to reach any host but
    the local one (so a page that needs the network shows it: the request fails, and is logged)."""
    _need_browser()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:  # a test dependency: missing, it fails the test rather than skip it
        pytest.fail("selenium is not installed: pip install -e '.[test]'", pytrace=False)
    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},{HEIGHT}",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-extensions",
        "--no-first-run",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        # the window's size in headless mode includes room for a browser frame: set the page's own
        metrics = {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        driver.set_script_timeout(20)
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # no line per request on stderr
        pass


@pytest.fixture(scope="module")
def served_site(site_build):
    """The built site over http on a free port of 127.0.0.1: its root URL."""
    assert site_build.proc.returncode == 0, site_build.failure()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site_build.site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _look(driver, url: str, local: str) -> tuple[list[str], dict | None]:
    """Open url, wait for its fonts, and return what is wrong with it (layout, highlighting,
    requests outside `local`, failed requests, errors logged) and its code colours."""
    for log in ("performance", "browser"):  # drop what earlier pages left
        driver.get_log(log)
    driver.get(url)
    driver.execute_async_script(WAIT_FOR_FONTS_JS)
    problems = list(driver.execute_script(LAYOUT_JS))
    colours = driver.execute_script(COLOURS_JS)
    if colours and colours["kn"] == colours["plain"]:
        problems.append(f"code is not highlighted: a keyword (.kn) shows in the plain text's colour {colours['plain']}")
    elif colours and colours["tokens"] and not colours["coloured"]:
        problems.append(f"code is not highlighted: none of its {colours['tokens']} tokens has a colour of its own")
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            asked = message["params"]["request"]["url"]
            if not asked.startswith((local, "data:", "blob:", "about:")):
                problems.append(f"it asks for {asked[:120]}: it would not read offline")
        elif message["method"] == "Network.responseReceived":
            response = message["params"]["response"]
            if response["status"] >= 400:
                problems.append(f"{response['url'][:120]} answered {response['status']}")
    for entry in driver.get_log("browser"):
        if entry["level"] == "SEVERE":
            problems.append(f"it logs an error: {entry['message'][:200]}")
    return problems, colours


def _colours_shown(png: bytes, box: tuple[int, int, int, int]) -> int:
    """How many distinct colours the screenshot shows inside box (up to 257)."""
    found = Image.open(io.BytesIO(png)).convert("RGB").crop(box).getcolors(maxcolors=256)
    return 257 if found is None else len(found)


def _source(page: str) -> str:
    """The Markdown file a built page comes from: 'runtime/' -> 'docs/runtime.md'."""
    stem = page.rstrip("/")
    if stem and (ROOT / "docs" / f"{stem}.md").is_file():
        return f"docs/{stem}.md"
    return f"docs/{stem + '/' if stem else ''}index.md"


def test_every_page_reads_at_1280_px_offline_with_highlighted_code(browser, served_site, site_build, tmp_path):
    shots = tmp_path / "screens"
    shots.mkdir()
    pages = sorted(p.parent.relative_to(site_build.site).as_posix() for p in site_build.site.rglob("index.html"))
    pages = [("" if p == "." else p + "/") for p in pages]
    assert len(pages) >= 20, pages  # every page of the navigation
    problems, highlighted = [], []
    for page in pages:
        found, colours = _look(browser, served_site + page, served_site)
        if colours and colours["kn"]:
            highlighted.append(page)
        slug = page.rstrip("/").replace("/", "-") or "index"
        png = browser.get_screenshot_as_png()
        (shots / f"{slug}.png").write_bytes(png)
        size = Image.open(io.BytesIO(png)).size
        shown = _colours_shown(png, (SIDEBAR, 0, WIDTH - 20, HEIGHT))
        if size != (WIDTH, HEIGHT):
            found.append(f"its screenshot is {size[0]}x{size[1]}, not {WIDTH}x{HEIGHT}")
        elif shown <= 8:
            found.append(f"its screenshot looks blank: the text column shows {shown} colours ({slug}.png)")
        # the widest table in view too, to see what the layout check measured
        if browser.execute_script(
            "const t = Array.from(document.querySelectorAll('table')).sort((a, b) => b.scrollWidth - a.scrollWidth)[0];"
            "if (t) t.scrollIntoView({block: 'start'}); return !!t;"
        ):
            (shots / f"{slug}-table.png").write_bytes(browser.get_screenshot_as_png())
        problems += [f"{page or '/'} ({_source(page)}): {p}" for p in found]
    assert not problems, f"{len(problems)} problems at {WIDTH}x{HEIGHT} (screenshots in {shots}):\n" + "\n".join(
        problems
    )
    # the highlighting check looked at Python code where there is some, not only at shell sessions
    assert {"runtime/", "launching/", "outputs/"} <= set(highlighted), highlighted


def test_the_checks_report_a_wide_table_plain_code_and_a_request_elsewhere(browser, tmp_path):
    page = tmp_path / "wide.html"
    page.write_text(
        "<!doctype html><html><body>"
        "<h2>Wide</h2><table><tr><th>first</th><th>last</th></tr>"
        f"<tr><td><div style='width: 1100px'>{'word ' * 100}</div></td><td style='white-space: nowrap'>{'end ' * 30}</td></tr></table>"
        "<h2>Scrolled</h2><div class='wrapper' style='overflow: auto'>"
        "<table style='width: 3000px'><tr><th>a</th><th>b</th></tr></table></div>"
        "<div class='codehilite'><pre><code><span class='kn'>import</span> os</code></pre></div>"
        "<img src='http://example.com/logo.png' alt=''>"
        "</body></html>"
    )
    problems, _ = _look(browser, page.as_uri(), "file://")
    said = "\n".join(problems)
    assert "it scrolls sideways" in said, said
    assert "table 1 under 'Wide' (first | last) ends at x=" in said, said
    assert "column 2 ('last') ends at x=" in said, said
    assert "table 2 under 'Scrolled' (a | b) needs its box (wrapper) scrolled sideways: 3000 px" in said, said
    assert "a keyword (.kn) shows in the plain text's colour" in said, said
    assert "it asks for http://example.com/logo.png" in said, said
