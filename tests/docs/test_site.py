"""The built documentation site (``sphinx-build -W -n -b html docs docs/_build/html``, .ci/run's stage
1b): every internal link and anchor resolves, and a real headless Chromium, served the folder by
``python -m http.server``, loads the front page with no console error and follows its navigation.

Without a build these skip, saying so; ``FLODL_TEST_DOCS=require`` (.ci/run) makes that a failure.
The browser is Debian's ``chromium`` driven by playwright (playwright's own browser download is not
reachable from CI); as root it is installed with apt-get when missing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

SITE = Path(__file__).resolve().parents[2] / "docs" / "_build" / "html"
REQUIRE = os.environ.get("FLODL_TEST_DOCS") == "require"


def _need(ok: bool, why: str) -> None:
    if not ok:
        if REQUIRE:
            pytest.fail(f"FLODL_TEST_DOCS=require: {why}")
        pytest.skip(why)


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key) and not (tag == "link" and a.get("rel") in ("canonical",)):
                self.links.append(a[key])


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(errors="replace"))
    return p


def test_every_internal_link_resolves():
    _need((SITE / "index.html").exists(), f"no built site at {SITE} (run sphinx-build first)")
    pages = sorted(SITE.rglob("*.html"))
    parsed = {p: _parse(p) for p in pages}
    broken = []
    for page, links in parsed.items():
        for link in links.links:
            url = urlsplit(link)
            if url.scheme or url.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(SITE)}: {link}")
            elif url.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if url.fragment not in ids:
                    broken.append(f"{page.relative_to(SITE)}: {link} (no such anchor)")
    assert len(pages) >= 30
    assert not broken, "\n".join(broken[:40])
    # the generated parts are there: every CLI option of the parser, the figures, the exit codes
    from flodl_mpi.cli.main import build_parser

    cli = (SITE / "reference" / "cli.html").read_text()
    train = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    missing = [s for act in train._actions for s in act.option_strings if s.startswith("--") and s not in cli]
    assert not missing, missing
    assert (SITE / "_images" / "timelines.png").exists() and (SITE / "_images" / "masses.png").exists()
    assert "EXIT_STOPPED" in (SITE / "reference" / "exit-codes.html").read_text()


def _chromium() -> str | None:
    for path in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if path and os.access(path, os.X_OK):
            return path
    if os.geteuid() == 0 and REQUIRE and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "chromium"]
        # A fresh machine may have no package lists yet: update them once if the first try fails.
        for step in ([install], [["apt-get", "update", "-qq"], install]):
            if os.access("/usr/lib/chromium/chromium", os.X_OK):
                break
            for command in step:
                subprocess.run(command, check=False, capture_output=True, timeout=600, env=env)
        return "/usr/lib/chromium/chromium" if os.access("/usr/lib/chromium/chromium", os.X_OK) else None
    return None


def test_the_front_page_in_a_headless_browser():
    """index.html over http: it loads (its title), no console error or page error, and the first
    links of its navigation sidebar open pages that load without errors either."""
    _need((SITE / "index.html").exists(), f"no built site at {SITE} (run sphinx-build first)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "playwright is not installed (the docs extra installs it)")
    browser_path = _chromium()
    _need(browser_path is not None, "no chromium (Debian's package: apt-get install chromium, as root)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d",
                               str(SITE)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        errors = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})  # wide: furo shows its sidebar
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            base = f"http://127.0.0.1:{port}/"
            response = page.goto(base + "index.html")
            assert response.status == 200
            assert page.title().startswith("flodl-mpi")
            nav = page.locator(".sidebar-tree a.reference:visible")
            hrefs = [nav.nth(i).get_attribute("href") for i in range(nav.count())]
            assert len(hrefs) >= 5, hrefs
            for href in hrefs[:5]:
                page.goto(base + "index.html")
                page.locator(f'.sidebar-tree a.reference[href="{href}"]:visible').first.click()
                page.wait_for_load_state("load")
                assert page.url.split("#")[0].endswith(href.split("#")[0]), (page.url, href)
                assert page.locator("article h1").count() == 1, page.url
            browser.close()
        assert not errors, errors
    finally:
        server.terminate()
        server.wait(timeout=10)
