"""The documentation site builds strictly: a broken link or anchor, a page missing from the
navigation, or a docstring the API reference cannot render fails the test run. The built site
reads offline (code highlighted at build time, no script from a CDN), wide tables wrap, and the
API reference names each object once, without internals."""

from __future__ import annotations

import importlib.util
import re

import pytest

pytestmark = pytest.mark.cli  # a subprocess: the mkdocs command


def test_docs_build_strictly_without_warnings(site_build):
    # mkdocs and mkdocstrings are test dependencies: missing, they fail this test, not skip it.
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        assert importlib.util.find_spec(module), f"{module} is not installed: pip install -e '.[test]'"
    # built once for the docs tests (tests/docs/conftest.py): test_screens.py reads the same site
    assert site_build.proc.returncode == 0, site_build.failure()
    site = site_build.site
    assert (site / "index.html").is_file()
    pages = {p.relative_to(site).as_posix(): p.read_text() for p in site.rglob("index.html")}
    for name, html in pages.items():  # offline: nothing highlighted in the browser, nothing fetched
        assert "hljs" not in html and "highlight.min.js" not in html, name
        assert not re.search(r'<script[^>]+src="https?://', html), name
    runtime = pages["runtime/index.html"]
    assert runtime.count('class="codehilite"') >= 10 and '<span class="kn">import</span>' in runtime
    assert (site / "css" / "pygments.css").is_file() and "css/tables.css" in runtime
    assert "white-space: normal" in (site / "css" / "tables.css").read_text()
    reference = pages["reference/index.html"]
    headings = re.findall(r'<h[2-4] id="([^"]+)"', reference)
    # each object named once: no heading of the page's own ('collector', 'errors') beside the
    # object's ('ddpkit.runtime.gather.Collector', 'ddpkit.errors'); a class and a function may differ
    # in case alone (ddpkit.core.draws.Dropout and ddpkit.core.draws.dropout)
    objects = [h for h in headings if 1 <= h.count(".") <= 2]
    own = [h for h in headings if "." not in h]
    assert len(objects) == len(set(objects)), sorted(objects)
    assert not {h.lower() for h in own} & {h.rsplit(".", 1)[-1].lower() for h in objects}, own
    assert "ddpkit.runtime.Runtime.env" not in headings and "ddpkit.runtime.Runtime.ddp_options" not in headings
    assert "ddpkit.runtime.Runtime.device" in headings and "detect_env" not in reference  # no values shown
    assert {"ddpkit.runtime.Runtime.all_reduce", "ddpkit.runtime.Runtime.rank"} <= set(headings)  # (of Collectives)
