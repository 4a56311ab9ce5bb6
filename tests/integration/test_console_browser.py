"""The live console in headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium): the page loads from the broker alone, its figures move while a paho
publisher runs, and it asks for the HTTP API's credentials when anonymous access is off.

Each test keeps a screenshot: under its pytest tmp dir, and a copy under
``$MQLOG_ARTIFACTS`` (default: the system temp dir's ``mqlog-artifacts/``), whose path it
prints. Skipped, with the reason, only when Chromium cannot be started.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.integration.clients import V5, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess
from tests.integration.test_auth import make_password_file

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--window-size=1400,1700",
)
#: Seconds to wait for the page to show what the test expects (it polls every 2 s).
WAIT = 30
ARTIFACTS = Path(os.environ.get("MQLOG_ARTIFACTS", Path(tempfile.gettempdir()) / "mqlog-artifacts"))


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """One Chromium for the module (a start costs seconds); every broker is its own origin."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        # The driver's path is given, so selenium looks nothing up on the network.
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    except WebDriverException as e:
        pytest.skip(f"Chromium cannot start ({CHROMIUM} via {CHROMEDRIVER}): {e.msg}")
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def chromium(browser: webdriver.Chrome) -> webdriver.Chrome:
    """The module's Chromium on a blank page, its console log emptied (``get_log`` returns
    what came since its last call), so a test's ``browser_errors`` are its own."""
    browser.get("about:blank")
    browser.get_log("browser")
    return browser


class Publisher:
    """A paho client publishing QoS 1 messages on its own thread until stopped."""

    def __init__(self, port: int, topic: str, user: tuple[str, str] | None = None) -> None:
        self.client = Client(port, "console-publisher")
        if user is not None:
            self.client.paho.username_pw_set(*user)
        assert self.client.connect() == 0
        self.topic = topic
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in range(20):
                self.client.publish(f"{self.topic}/{self.sent % 16}", b"m" * 120, qos=1, wait=False)
                self.sent += 1
            self._stop.wait(0.01)  # ~2,000 messages/s at most: load, not a flood

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.disconnect()


def text(driver: webdriver.Chrome, element_id: str) -> str:
    return shown(driver, f"#{element_id}")


def shown(driver: webdriver.Chrome, selector: str) -> str:
    """The rendered text of the element ``selector`` finds, read in one script: the page
    replaces its tables on every update, so an element found first and read after could be
    gone (stale) by then."""
    script = "const e = document.querySelector(arguments[0]); return e && e.innerText;"
    value = driver.execute_script(script, selector)
    if value is None:
        raise NoSuchElementException(f"no element {selector}")  # waits ignore this one
    return str(value)


def updates(driver: webdriver.Chrome) -> int:
    return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-updates") or 0)


def keep_screenshot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(shot)), "the screenshot was not written"
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    kept = ARTIFACTS / shot.name
    shutil.copyfile(shot, kept)
    print(f"console screenshot: {kept}")
    return kept


def browser_errors(driver: webdriver.Chrome) -> list[str]:
    """Console errors: a failed load, a script error, a Content-Security-Policy refusal."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def watch_figures_move(driver: webdriver.Chrome, publisher: Publisher) -> None:
    """The page shows data, then new data while ``publisher`` runs."""
    wait = WebDriverWait(driver, WAIT, poll_frequency=0.2)
    wait.until(lambda d: updates(d) >= 1)
    assert text(driver, "status") == "live"
    first = int(text(driver, "messages-received").replace(",", ""))
    wait.until(lambda d: int(text(d, "messages-received").replace(",", "")) > first)
    # The rates, the chart and the partition's high-water mark follow.
    wait.until(lambda d: float(text(d, "rate-received").replace(",", "")) > 0)
    wait.until(lambda d: float(text(d, "rate-stored").replace(",", "")) > 0)
    mark = 'td[data-key="default/0"]'
    seen = int(shown(driver, mark).replace(",", ""))
    wait.until(lambda d: int(shown(d, mark).replace(",", "")) > seen)
    lines = driver.execute_script(
        "return [...document.querySelectorAll('#chart polyline')]"
        ".map(l => [l.getAttribute('class'), l.getAttribute('points')]);"
    )
    assert {cls for cls, _ in lines} == {"received", "sent", "stored"}
    assert all(len(points.split()) >= 2 for _, points in lines)
    assert text(driver, "cluster-mode") == "single node"
    assert "single node" in text(driver, "cluster-note")
    assert publisher.sent > 0


def test_console_moves_under_load(
    broker_factory: BrokerFactory, chromium: webdriver.Chrome, tmp_path: Path
) -> None:
    broker = broker_factory()
    # Something in every panel: a persistent session that fell behind, a shared group.
    away = Client(broker.port, "sensor-archive", V5, clean=False, session_expiry=3600)
    assert away.connect() == 0
    assert away.subscribe("plant/#", 1) == [1]
    away.disconnect()
    member = Client(broker.port, "dashboard-1")
    assert member.connect() == 0
    assert member.subscribe("$share/dashboards/plant/#", 1) == [1]
    publisher = Publisher(broker.port, "plant/line-1")
    try:
        chromium.get(broker.http_url + "/")
        assert chromium.title == "mqlog console"
        watch_figures_move(chromium, publisher)
        wait = WebDriverWait(chromium, WAIT, poll_frequency=0.2)
        wait.until(lambda d: "sensor-archive" in text(d, "sessions"))
        assert "offline" in text(chromium, "sessions")
        assert "dashboards" in text(chromium, "groups")
        assert "dashboard-1" in text(chromium, "groups")
        # Several points of throughput in the chart before the picture is taken.
        wait.until(lambda d: updates(d) >= 4)
        keep_screenshot(chromium, tmp_path, f"console-w{broker.workers}")
    finally:
        publisher.stop()
        member.disconnect()
    assert browser_errors(chromium) == []


def http_status(broker: BrokerProcess, path: str, auth: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(broker.http_url + path)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.headers.get("WWW-Authenticate", "")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("WWW-Authenticate", "")


def test_console_behind_credentials(
    broker_factory: BrokerFactory, chromium: webdriver.Chrome, tmp_path: Path
) -> None:
    # The HTTP API's authentication is built beside the console (issue 24, item 6).
    passwords = make_password_file(tmp_path / "passwd", {"operator": "s3cret-console"})
    broker = broker_factory(
        config=f'[auth]\nallow_anonymous = false\npassword_file = "{passwords}"\n'
    )
    # Without credentials: refused with the challenge that makes a browser prompt.
    for path in ("/", "/console/console.js", "/api/v1/console"):
        status, challenge = http_status(broker, path)
        assert (status, challenge.split()[0]) == (401, "Basic"), path
        assert http_status(broker, path, "operator:wrong")[0] == 401
        assert http_status(broker, path, "operator:s3cret-console")[0] == 200
    publisher = Publisher(broker.port, "console/t", user=("operator", "s3cret-console"))
    try:
        # What a user typing into the browser's prompt gets: the page and every request it
        # makes carry the credentials.
        host = broker.http_url.removeprefix("http://")
        chromium.get(f"http://operator:s3cret-console@{host}/")
        assert chromium.title == "mqlog console"
        watch_figures_move(chromium, publisher)
        keep_screenshot(chromium, tmp_path, f"console-credentials-w{broker.workers}")
    finally:
        publisher.stop()
    assert browser_errors(chromium) == []
