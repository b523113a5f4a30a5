"""Open a DAG's trigger form in the Airflow 3 UI with headless Chromium (DevTools protocol) and
screenshot it. No URL opens the form: the script clicks the Trigger button like a user."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import websockets

FORM_OPEN = "[...document.querySelectorAll('[role=dialog]')].some(d => d.innerText.includes('offset_ranges'))"
FORM_TEXT = "[...document.querySelectorAll('[role=dialog]')].find(d => d.innerText.includes('offset_ranges')).innerText"


class _Page:
    def __init__(self, ws) -> None:
        self.ws, self.ids = ws, itertools.count(1)

    async def send(self, method: str, **params):
        message_id = next(self.ids)
        await self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def js(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    async def wait(self, expression: str, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.js(expression):
                return
            await asyncio.sleep(0.25)
        raise TimeoutError(expression)


def _start_chromium(profile: Path, width: int, height: int) -> tuple[subprocess.Popen, int]:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: run the suite through ./kafka2pg test, which installs it"
    proc = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--window-size={width},{height}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # Its shared-memory folders (org.chromium.Chromium.*, in TMPDIR with --disable-dev-shm-usage)
        # outlive a SIGTERM: kept in the profile, which is removed after.
        env={**os.environ, "TMPDIR": str(profile)},
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("chromium did not start its DevTools endpoint")
        time.sleep(0.1)
    return proc, int(port_file.read_text().split()[0])


@contextlib.contextmanager
def _chromium(width: int, height: int) -> Iterator[int]:
    """A headless Chromium with a throwaway profile for the block; yields its DevTools port."""
    profile = Path(tempfile.mkdtemp(prefix="kafka2pg-chromium-"))
    proc, port = _start_chromium(profile, width, height)
    try:
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


@contextlib.asynccontextmanager
async def _open_page(port: int, width: int, height: int, *, network: bool = False) -> AsyncIterator[_Page]:
    """The browser's page over DevTools, its domains enabled and its viewport `width` x `height`."""
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))  # noqa: S310 - local DevTools
    ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
    async with websockets.connect(ws_url, max_size=64 * 2**20) as ws:
        page = _Page(ws)
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        if network:
            await page.send("Network.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
        )
        yield page


async def _save_screenshot(page: _Page, out: Path) -> None:
    shot = await page.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    out.write_bytes(base64.b64decode(shot["data"]))


async def _capture(port: int, url: str, out: Path, width: int, height: int) -> str:
    async with _open_page(port, width, height) as page:
        await page.send("Page.navigate", url=url)
        await page.wait("!!document.querySelector('[data-testid=trigger-dag-button]:not([disabled])')")
        await page.js("document.querySelector('[data-testid=trigger-dag-button]').click()")
        await asyncio.sleep(0.5)
        # When the button opens a menu, pick the plain trigger.
        await page.js(
            "(() => { const i = document.querySelector('[role=menuitem][data-value=trigger]'); if (i) i.click(); })()"
        )
        await page.wait(FORM_OPEN)
        await asyncio.sleep(1.0)  # fonts and the JSON editor settle
        text = await page.js(FORM_TEXT)
        await _save_screenshot(page, out)
        return text


def screenshot_trigger_form(base_url: str, dag_id: str, out: Path, width: int = 1400, height: int = 1300) -> str:
    """Screenshot of the DAG's trigger form at `out`; returns the form's text."""
    with _chromium(width, height) as port:
        return asyncio.run(_capture(port, f"{base_url}/dags/{dag_id}", out, width, height))


async def _capture_page(port: int, url: str, cookie: dict, out: Path, width: int, height: int, read: str):
    async with _open_page(port, width, height, network=True) as page:
        await page.send("Network.setCookie", url=url, **cookie)
        await page.send("Page.navigate", url=url)
        await page.wait("document.readyState === 'complete' && !!document.querySelector('table')")
        found = await page.js(read)
        await _save_screenshot(page, out)
        return found


def screenshot_page(
    url: str, cookie: dict, out: Path, width: int = 1400, height: int = 900, *, read: str = "document.body.innerText"
):
    """Screenshot of a server-rendered page opened with `cookie` (name, value) at `out`; returns the
    value of the JavaScript expression `read` on the page (default: its text)."""
    with _chromium(width, height) as port:
        return asyncio.run(_capture_page(port, url, cookie, out, width, height, read))


FRAMED_LINK = """(() => {
    const frame = document.querySelector('iframe');
    const link = frame && frame.contentDocument && frame.contentDocument.querySelector(SELECTOR);
    if (!link) return null;
    link.scrollIntoView({block: 'center', inline: 'center'});
    const outer = frame.getBoundingClientRect(), inner = link.getBoundingClientRect();
    return {x: outer.left + inner.left + inner.width / 2, y: outer.top + inner.top + inner.height / 2,
            frame: frame.contentWindow.location.pathname, top: location.pathname};
})()"""


async def _click_in_frame(port, url, cookie, selector, arrived, out, width, height) -> dict:
    async with _open_page(port, width, height, network=True) as page:
        await page.send("Network.setCookie", url=url, **cookie)
        await page.send("Page.navigate", url=url)
        find = FRAMED_LINK.replace("SELECTOR", json.dumps(selector))
        await page.wait(f"!!{find}", timeout_s=120)
        before, deadline = await page.js(find), time.monotonic() + 60
        while True:  # the UI's and the frame's layout settled: the link stays where it is
            await asyncio.sleep(0.5)
            again = await page.js(find)
            if again == before or time.monotonic() > deadline:
                break
            before = again
        for kind in ("mousePressed", "mouseReleased"):  # a user's click, not a script's
            await page.send(
                "Input.dispatchMouseEvent", type=kind, x=before["x"], y=before["y"], button="left", clickCount=1
            )
        await page.wait(arrived, timeout_s=120)
        await asyncio.sleep(1.0)  # the page's data settles
        after = await page.js(
            "({top: location.pathname, frames: document.querySelectorAll('iframe').length,"
            " text: document.body.innerText})"
        )
        await _save_screenshot(page, out)
        await page.js("history.back()")  # the browser's Back button
        back = "(() => { const f = document.querySelector('iframe'); return f && f.contentDocument"
        back += f" && f.contentWindow.location.pathname === {json.dumps(before['frame'])}"
        back += f" && !!f.contentDocument.querySelector({json.dumps(selector)}) && location.pathname; }})()"
        await page.wait(f"!!{back}", timeout_s=120)
        return {"before": before, "after": after, "back": await page.js(back)}


def click_in_frame(url: str, cookie: dict, selector: str, arrived: str, out: Path, width=1400, height=900) -> dict:
    """Open the Airflow UI at `url` (signed in with `cookie`), click the first `selector` inside the
    page's frame (the plugin's view) with the mouse, wait until the JavaScript expression `arrived`
    holds in the UI's window, screenshot it at `out`, then go Back and wait for the frame to show
    its page again; returns where the frame and the UI were before the click, the UI's path, frame
    count and text after, and the UI's path once back."""
    with _chromium(width, height) as port:
        return asyncio.run(_click_in_frame(port, url, cookie, selector, arrived, out, width, height))
