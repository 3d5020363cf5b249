"""The trainer's dashboard in headless Chromium, with live data from a running demo stack.

The stack is `sparsecast demo --keep-running` (shortened, small random model); after the browser
checks, SIGINT must stop the demo and every process it started.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.demo_helpers import DemoRun, read_env_file

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1700"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _worker_budget(env: dict[str, str]) -> int:
    workers = httpx.get(env["SPARSECAST_TRAINER_URL"] + "/v1/status").json()["workers"]
    return next(w["kv_budget"] for w in workers if w["worker_id"] == "demo-worker-1")


def _wait(driver, condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(condition)
        if value:
            return value
        if time.monotonic() > deadline:
            logs = driver.execute_script("return document.getElementById('error').textContent")
            raise AssertionError(f"dashboard: no {what} after {timeout}s (page error: {logs!r})")
        time.sleep(0.5)


def test_dashboard_shows_live_data_and_the_demo_stops_on_ctrl_c(tmp_path: Path, tiny_model_dir: str,
                                                                  browser) -> None:
    folder = tmp_path / "demo"
    run = DemoRun(
        "--steps",
        "3",
        "--workers",
        "1",
        "--groups",
        "2",
        "--samples",
        "4",
        "--model",
        tiny_model_dir,
        "--dir",
        str(folder),
        "--keep-running",
    )
    try:
        run.wait_for("the stack keeps running", timeout=400)
        env = read_env_file(folder / "stack.env")
        browser.get(env["SPARSECAST_TRAINER_URL"] + "/")
        assert browser.title == "sparsecast dashboard"
        _wait(
            browser,
            "return document.getElementById('state').textContent === 'finished'",
            30,
            "finished state",
        )
        _wait(
            browser, "return document.querySelectorAll('#versions tbody tr').length === 4", 30, "4 versions"
        )

        # The trainer samples worker throughput every 5 s: the chart waits for a sample with the worker.
        _wait(browser, "return [...document.querySelectorAll('#chart-throughput path')]"
                       ".some(p => p.dataset.name === 'demo-worker-1')", 20, "a throughput sample")
        # Charts render: line charts have a path through every step, the patch chart a bar per patch.
        paths = browser.execute_script("""
            const out = {};
            for (const svg of document.querySelectorAll('svg.chart')) {
              out[svg.id] = [...svg.querySelectorAll('path')].map(p => [p.dataset.name, p.getAttribute('d')]);
            }
            return out;""")
        reward = dict(paths["chart-reward"])
        assert set(reward) == {"reward", "accuracy"}
        assert all(d.count("L") == 2 for d in reward.values()), reward  # three steps: M + 2 L
        assert dict(paths["chart-patch"])["patch bytes"].count("Z") == 3  # v1..v3
        assert len(paths["chart-changed"]) == 1 and len(paths["chart-kv"]) >= 1
        assert {n for n, _ in paths["chart-corrections"]} == {
            "rejected sequences",
            "masked tokens",
            "PPO clipped",
        }
        assert dict(paths["chart-throughput"]).get("demo-worker-1"), paths["chart-throughput"]

        text = browser.execute_script("return document.body.innerText")
        assert "run demo" in text and "step 3/3" in text and "demo-worker-1" in text
        # The demo sizes the workers' first budget (and the controller may move it): the page shows
        # what the worker last reported to the trainer.
        assert f"rkv @{_worker_budget(env)}" in text
        assert browser.find_element("id", "error").get_attribute("hidden") is not None
        kv = browser.find_element("id", "kpi-kv").text
        last = httpx.get(env["SPARSECAST_TRAINER_URL"] + "/v1/status").json()["last"]
        assert kv == f"{100 * last['kv_saved']:.1f}%", (kv, last["kv_saved"])
        # Loss/grad-norm, KL/entropy and step-time charts draw a line through the three steps.
        assert {n for n, _ in paths["chart-loss"]} == {"loss", "grad norm"}
        assert {"KL old‖sampler", "entropy"} <= {n for n, _ in paths["chart-kl"]}
        assert all(d.count("L") == 2 for n, d in paths["chart-steptime"]), paths["chart-steptime"]
        # Cards show the last step, and the mean over the run below it.
        assert "last step · mean of 3" in browser.find_element("id", "kpi-reward-mean").text
        # Throughput comes from the server's samples, taken before this page was opened.
        samples = browser.execute_script("return fetch('v1/metrics/throughput').then(r => r.json())")
        assert samples["interval_s"] == 5 and samples["samples"], samples
        assert min(r["time"] for r in samples["samples"]) < time.time() - 1
        # Links to the metrics and the (offline) API docs.
        links = browser.execute_script("return [...document.querySelectorAll('header a')].map(a => a.href)")
        assert [link.rsplit("/", 1)[1] for link in links] == ["metrics", "docs", "redoc"]
        # The lease table and the queue card read the same Redis list: they agree.
        _wait(browser, "return document.getElementById('leases-note').textContent !== ''", 10, "lease table")
        leased = browser.execute_script(
            "return document.querySelectorAll('#leases tbody tr:not(.expired)').length")
        card = browser.find_element("id", "kpi-queue").text
        assert f"{leased} leased" in card, (leased, card)
        assert browser.find_element("id", "dead-note").text == "(0)"
        # Pause and resume from the page (the token asked once, kept for the tab).
        browser.execute_script("sessionStorage.setItem('sparsecast-token', arguments[0])",
                               env["SPARSECAST_API_TOKEN"])
        browser.find_element("id", "pause").click()
        badge = "document.getElementById('state').textContent"
        _wait(browser, f"return {badge}.endsWith('(paused)')", 15, "paused")
        assert "paused at step 3" in browser.find_element("id", "notice").text
        browser.save_screenshot(str(tmp_path / "dashboard-paused.png"))
        browser.find_element("id", "resume").click()
        _wait(browser, f"return !{badge}.includes('paused')", 15, "resumed")
        # The worker reports its version on its next heartbeat after syncing to v3.
        # ...and from then on samples under the budget published with v3.
        _wait(browser, "return [...document.querySelectorAll('#workers tbody td')].map(td => td.textContent)"
                       f".slice(0, 4).join('|') === 'demo-worker-1|native|rkv @{last['kv_budget']}|v3'",
              30, "worker at v3")
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000

        run.popen.send_signal(signal.SIGINT)
        code = run.wait(timeout=90)
    finally:
        run.stop()
    assert code == 0, run.output
    assert "stopping every process the demo started" in run.output
    assert not (folder / "stack.env").exists()
    assert run.leftovers() == []
