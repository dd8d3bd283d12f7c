"""Open the built site in headless Chromium and check that it renders, offline.

`make docs-check` (after `make docs`): serves `site/` on 127.0.0.1 (a free port,
stopped at the end), opens the front page, the API page of `Proxy` and the
benchmarks page with Debian's chromium and chromedriver (`apt-get install chromium
chromium-driver`; selenium comes with the `docs` extra), and checks on each: the
title, the element it is about, every image loaded (`naturalWidth > 0`), nothing
fetched from another host, and no SEVERE entry in the browser's console. Saves a
screenshot of the front page to `docs/screenshot.png` (the README shows it).
Exits 1 if any page fails.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parent.parent
WINDOW = (1280, 800)
SETTLE_SECONDS = 0.5  # for scripts that log after the load event


@dataclass(frozen=True)
class Check:
    path: str
    title: str  # the page's <title> starts with this
    element_id: str  # an element the page is about
    min_images: int  # images that must be on the page (all of them must load)


CHECKS = [
    Check("/", "batchproxy", "a-batched-web-service-in-one-file", 1),
    Check("/reference/proxy/", "Proxy and @batch", "batchproxy.Proxy", 0),
    Check("/benchmarks/", "Benchmarks", "beside-the-peers", 2),
]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No access log on stderr."""


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve `directory` on 127.0.0.1 at a free port; yield its base URL."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="site-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """Headless Debian chromium through the system chromedriver (nothing downloaded)."""
    driver_path = shutil.which("chromedriver")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if driver_path is None or binary is None:
        raise SystemExit(
            "needs chromium and chromedriver: apt-get install chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def check_page(driver: webdriver.Chrome, base: str, check: Check) -> list[str]:
    """Load one page; return what is wrong with it (nothing: it renders)."""
    driver.get(base + check.path)
    time.sleep(SETTLE_SECONDS)
    problems = []
    if not driver.title.startswith(check.title):
        problems.append(f"title {driver.title!r}, expected {check.title!r}...")
    if not driver.find_elements(By.ID, check.element_id):
        problems.append(f"no element #{check.element_id}")
    images = driver.execute_script(
        "return Array.from(document.images, i => [i.src, i.complete && i.naturalWidth]);"
    )
    if len(images) < check.min_images:
        problems.append(f"{len(images)} images, expected at least {check.min_images}")
    problems += [f"image not loaded: {src}" for src, width in images if not width]
    resources = driver.execute_script(
        "return performance.getEntriesByType('resource').map(r => r.name);"
    )
    problems += [f"fetched from elsewhere: {url}" for url in resources if not url.startswith(base)]
    problems += [
        f"console: {entry['message']}"
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE"
    ]
    if problems:
        print(f"FAIL {check.path}: " + "; ".join(problems))
    else:
        print(
            f"ok   {check.path}: title {driver.title!r}, {len(images)} image(s) loaded, "
            f"{len(resources)} resources fetched, all local, no console errors"
        )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site")
    parser.add_argument("--screenshot", type=Path, default=ROOT / "docs" / "screenshot.png")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        raise SystemExit(f"no site in {args.site}: run `make docs` first")
    failed = False
    with serve(args.site) as base, chromium() as driver:
        print(f"serving {args.site} at {base}; {driver.capabilities['browserVersion']}")
        for check in CHECKS:
            failed |= bool(check_page(driver, base, check))
            if check.path == "/" and not failed:
                driver.execute_script("window.scrollTo(0, 0);")
                driver.save_screenshot(str(args.screenshot))
                print(f"     screenshot of {check.path}: {args.screenshot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
