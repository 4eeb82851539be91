"""Look at a project's MLflow web UI in a real headless browser, as a user would, and check what it shows.

    python benchmarks/mlflow_ui_check.py --project PATH --out DIR [--port N] [--timeout S]

One-time setup (Debian; Playwright's own browser download does not work offline, so never `playwright install`)::

    apt-get install -y chromium          # gives /usr/bin/chromium
    pip install -e ".[ui-check]"         # Playwright: the Python driver only

What it does:

1. starts ``mlflow server --backend-store-uri sqlite:///<abs PATH>/mlflow.db --host 127.0.0.1 --port N`` (a free port
   unless ``--port``) in its own process group, waits (bounded) for ``/health``, and always kills the group at the end;
2. finds, through the server's REST API, the experiment with the most runs, a parent run (no ``mlflow.parentRunId``
   tag, with children), one ``train_dpo*`` child run, and the registered ``*_policy_hf`` models;
3. drives Debian's Chromium (headless, fresh profile) with Playwright over these hash routes of the single-page app,
   takes a full-page PNG of each, and asserts on the text a user would see:

   - experiments list, ``#/experiments``: the experiment's name;
   - experiment page, ``#/experiments/<id>``: where a first visit lands (a fact: MLflow 3.17 opens its GenAI view
     until the header's switch says "Model training", whatever the experiment's kind tag), then the README's link
     ``#/experiments/<id>?workflowType=machine_learning``: expected on the runs table; then the runs table after the
     header's "Model training" switch;
   - parent run, ``#/experiments/<id>/runs/<run>``: the parameter ``dpo.loss.beta``;
   - DPO child run, ``#/experiments/<id>/runs/<run>/model-metrics``: the TRL-named charts (``rewards/margins``,
     ``rewards/accuracies``, ``logps/chosen``) and a ``loss`` chart (and its history via REST);
   - registered models, ``#/models``: every model's name, the ``champion`` alias;
   - a policy model, ``#/models/<name>``, and its ``champion`` (else latest) version,
     ``#/models/<name>/versions/<v>``: ``champion``, version tags ``export.check`` and ``gates.passed``.

   "Visible" means on screen as a user sees it: scrolled to, not clipped by its scroll box nor covered by a pop-up.
   First-visit pop-ups (tips, announcements) are closed as a user would, and noted.
4. writes ``<out>/findings.md`` (per page: URL, screenshot, expected vs seen, pass/fail; plus the facts gathered:
   loss history length, metric keys, aliases, version tags) and exits 1 if any expectation failed, printing one
   ``FAIL <page>: <what>`` line per failed expectation. A project with no registered model is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1600, "height": 1000}
PARENT_PARAM = "dpo.loss.beta"
VERSION_TAGS = ("export.check", "gates.passed")
CHAMPION = "champion"
FEW_POINTS = 20  # a training curve with fewer points than this is noted as coarse


# --------------------------------------------------------------------------------------------------------------------
# MLflow server
# --------------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (else /health could answer from another server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class MlflowServer:
    """``mlflow server`` over ``<project>/mlflow.db`` as a subprocess in its own process group (context manager)."""

    def __init__(self, project: Path, port: int, workdir: Path, start_timeout: float = 120.0):
        self.project = project
        self.port = port
        self.workdir = workdir
        self.start_timeout = start_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "mlflow_server.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        db = (self.project / "mlflow.db").resolve()
        # The runs' artifact locations are absolute file:// URIs in the db, which the server reads directly:
        # no --default-artifact-root / --serve-artifacts are needed to browse existing runs.
        return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}",
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

    def __enter__(self) -> MlflowServer:  # noqa: PYI034
        log = open(self.log_path, "wb")
        # No telemetry from the server or its UI (nothing outside this machine is reachable anyway).
        env = dict(os.environ, PYTHONUNBUFFERED="1", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
        env.pop("MLFLOW_TRACKING_URI", None)
        try:
            # cwd = a scratch dir, so anything the server writes relative to its cwd stays out of the project.
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with code {self.proc.returncode} before answering; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.5)
        raise RuntimeError(f"mlflow server did not answer {self.url}/health within {self.start_timeout:.0f} s "
                           f"(last error: {last}); log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the whole process group (uvicorn workers included), SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self.stop()
        # Workers left in the group after the leader died: kill them too.
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Rest:
    """Minimal JSON client for the MLflow REST API of the running server."""

    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, body: dict | None = None, **query) -> dict:
        url = f"{self.base}/api/2.0/mlflow/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {url}: HTTP {e.code}: {e.read()[:500]!r}") from e

    def paged(self, path: str, body: dict, key: str) -> list[dict]:
        """All items of a POST search endpoint, following ``next_page_token``."""
        items, token = [], None
        while True:
            page = self.call("POST", path, {**body, **({"page_token": token} if token else {})})
            items += page.get(key, [])
            token = page.get("next_page_token")
            if not token:
                return items

    def experiments(self) -> list[dict]:
        return self.paged("experiments/search", {"max_results": 1000}, "experiments")

    def runs(self, experiment_id: str) -> list[dict]:
        return self.paged("runs/search", {"experiment_ids": [experiment_id], "max_results": 1000}, "runs")

    def metric_history(self, run_id: str, key: str) -> list[dict]:
        out, token = [], None
        while True:
            q = {"run_id": run_id, "metric_key": key, "max_results": 25000}
            if token:
                q["page_token"] = token
            page = self.call("GET", "metrics/get-history", **q)
            out += page.get("metrics", [])
            token = page.get("next_page_token")
            if not token:
                return out

    def registered_models(self) -> list[dict]:
        out, token = [], None
        while True:  # a GET endpoint, unlike runs/search
            query = {"max_results": 1000, **({"page_token": token} if token else {})}
            page = self.call("GET", "registered-models/search", **query)
            out += page.get("registered_models", [])
            token = page.get("next_page_token")
            if not token:
                return out

    def model_versions(self, name: str) -> list[dict]:
        return self.call("GET", "model-versions/search", filter=f"name='{name}'",
                         max_results=1000).get("model_versions", [])


def tags_of(entity: dict) -> dict[str, str]:
    """``{key: value}`` of a REST entity's ``tags`` list (runs keep them under ``data``)."""
    raw = entity.get("data", entity).get("tags", []) or []
    return {t["key"]: t.get("value", "") for t in raw}


def run_name(run: dict) -> str:
    return run["info"].get("run_name") or tags_of(run).get("mlflow.runName", "")


# --------------------------------------------------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Check:
    expected: str
    ok: bool
    seen: str


@dataclass
class PageReport:
    name: str
    url: str = ""
    screenshot: str = ""
    checks: list[Check] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    def expect(self, expected: str, ok: bool, seen: str) -> bool:
        self.checks.append(Check(expected, ok, seen))
        return ok

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def write_findings(out: Path, header: list[str], pages: list[PageReport]) -> Path:
    lines = ["# MLflow UI check", "", *header, ""]
    n_fail = sum(len(p.failed) for p in pages)
    result = (f"**Result: {'FAIL' if n_fail else 'PASS'}** ({n_fail} failed expectation(s) over "
              f"{sum(len(p.checks) for p in pages)}, {len(pages)} page(s))")
    lines += [result, ""]
    for p in pages:
        lines += [f"## {p.name}", ""]
        if p.url:
            lines.append(f"- URL: `{p.url}`")
        if p.screenshot:
            lines.append(f"- Screenshot: `{p.screenshot}`")
        for c in p.checks:
            lines.append(f"- {'PASS' if c.ok else 'FAIL'}: expected {c.expected} — seen: {c.seen}")
        for f in p.facts:
            lines.append(f"- Fact: {f}")
        lines.append("")
    path = out / "findings.md"
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------------------------------------------------
# Browser
# --------------------------------------------------------------------------------------------------------------------


class Browser:
    """Headless Debian Chromium through Playwright; one fresh tab per page visit, one profile for the whole check.

    The profile persists the UI's own settings between tabs (the GenAI / Model training switch, the assistant panel),
    as a user's browser would. Requests to anything but the local server are aborted.
    """

    def __init__(self, out: Path, profile: Path, server_url: str, timeout_ms: int):
        from playwright.sync_api import sync_playwright  # imported here so --help works without playwright

        self.out = out
        self.timeout_ms = timeout_ms
        self.console_errors: list[str] = []
        self.blocked: set[str] = set()
        self._pending: set = set()
        self._last_change = time.monotonic()
        self._pw = sync_playwright().start()
        self.context = self._pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT,
            locale="en-US", timezone_id="UTC")
        self.context.set_default_timeout(timeout_ms)
        local = urllib.parse.urlparse(server_url).netloc

        def route(r):
            netloc = urllib.parse.urlparse(r.request.url).netloc
            if netloc and netloc != local:
                self.blocked.add(netloc)
                return r.abort()
            return r.continue_()

        self.context.route("**/*", route)
        self.context.on("request", self._started)
        self.context.on("requestfinished", self._ended)
        self.context.on("requestfailed", self._ended)
        self.http_errors: set[str] = set()  # "<status> <path>" of the app's failed requests to the server
        self.context.on("response", lambda r: r.status >= 400 and self.http_errors.add(
            f"{r.status} {urllib.parse.urlparse(r.url).path}"))

    # Own "network idle" for the app's data calls: Playwright's networkidle never comes here (the UI's telemetry
    # web-worker script stays pending), so track fetch/XHR requests only.
    def _started(self, req) -> None:
        if req.resource_type in ("fetch", "xhr"):
            self._pending.add(req)
            self._last_change = time.monotonic()

    def _ended(self, req) -> None:
        if req in self._pending:
            self._pending.discard(req)
            self._last_change = time.monotonic()

    def close(self) -> None:
        try:
            self.context.close()
        finally:
            self._pw.stop()

    def open(self, url: str, rep: PageReport | None = None, dismiss: bool = True):
        """A new tab on ``url``, once the app's data requests have settled; with ``dismiss``, first-visit tips and
        announcements laid over the page are closed (and noted in ``rep``), as a user would before reading it."""
        page = self.context.new_page()
        page.on("console", lambda m: m.type == "error" and self.console_errors.append(f"{url}: {m.text[:200]}"))
        page.goto(url, wait_until="domcontentloaded")
        self.settle(page)
        if dismiss:
            for title in self.dismiss_dialogs(page):
                if rep is not None:
                    rep.facts.append(f"a first-visit pop-up '{title}' covered the page; closed it")
        return page

    def dismiss_dialogs(self, page) -> list[str]:
        """Close every visible dialog / popover (its "Close" or "Got it" button, else Escape); their titles."""
        closed: list[str] = []
        for _ in range(3):
            dialogs = page.locator('[role="dialog"]:visible')
            if not dialogs.count():
                break
            dialog = dialogs.first
            closed.append((dialog.inner_text().strip().splitlines() or ["(untitled)"])[0][:80])
            for name in ("Close", "Got it"):
                button = dialog.get_by_role("button", name=name, exact=True)
                if button.count():
                    button.first.click()
                    break
            else:
                page.keyboard.press("Escape")
            page.wait_for_timeout(500)
        return closed

    def settle(self, page, quiet_s: float = 1.0) -> None:
        """Wait (bounded by the timeout, never a failure) until no fetch/XHR has been in flight for ``quiet_s`` and
        no loading spinner / skeleton is visible."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        page.wait_for_timeout(300)  # let the app start its first requests
        while time.monotonic() < deadline:
            if not self._pending and time.monotonic() - self._last_change >= quiet_s:
                break
            page.wait_for_timeout(100)
        while time.monotonic() < deadline and page.evaluate(SPINNERS_JS):
            page.wait_for_timeout(200)
        page.wait_for_timeout(300)  # one last paint after the data arrived

    def visible(self, page, text: str, timeout_ms: int | None = None, exact: bool = False,
                on_screen: bool = True) -> bool:
        """Whether ``text`` is (or becomes, within the timeout) visible on the page.

        ``on_screen``: as a user sees it - scrolled into view like a user scrolls, and not clipped by its scroll box
        or covered by something else (the element itself is what the browser hit-tests at its centre). Without it,
        rendered and not hidden is enough (text under a modal's dimming mask, say)."""
        loc = page.get_by_text(text, exact=exact)
        deadline = time.monotonic() + (self.timeout_ms if timeout_ms is None else timeout_ms) / 1000
        while True:
            # The first match may be hidden (a tooltip, a collapsed menu) while another one shows.
            for i in range(min(loc.count(), 50)):
                item = loc.nth(i)
                try:
                    if not item.is_visible():
                        continue
                    if not on_screen:
                        return True
                    item.scroll_into_view_if_needed(timeout=2000)
                    if item.evaluate(ON_SCREEN_JS):
                        return True
                except Exception:  # noqa: BLE001, S112 - detached while the app re-rendered: try again
                    continue
            if time.monotonic() >= deadline:
                return False
            page.wait_for_timeout(200)

    def shot(self, page, name: str) -> str:
        path = self.out / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path.name


# Whether an element is on screen and on top: the browser's hit test at its centre lands on it (or inside it).
ON_SCREEN_JS = """el => {
  const r = el.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2;
  if (r.width === 0 || r.height === 0 || x < 0 || y < 0 || x >= innerWidth || y >= innerHeight) return false;
  const hit = document.elementFromPoint(x, y);
  return !!hit && (hit === el || el.contains(hit) || hit.contains(el));
}"""

# Any visible loading indicator of MLflow's design system (spinners, skeleton placeholders, progress bars).
SPINNERS_JS = """() => Array.from(document.querySelectorAll(
    '[data-testid*="spinner"], [class*="spin-spinning"], [role="progressbar"], [class*="Skeleton"], [class*="skeleton"]'
  )).some(e => e.offsetParent !== null && e.getBoundingClientRect().height > 0)"""


def body_text(page, limit: int = 300) -> str:
    """The page's visible text, squeezed to one line (for 'seen' notes)."""
    try:
        text = " ".join(page.inner_text("body").split())
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"(no text: {e})"
    return text[:limit] + ("…" if len(text) > limit else "")


# --------------------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------------------


def check_ui(server: MlflowServer, browser: Browser, project: Path) -> tuple[list[str], list[PageReport]]:
    """Visit every page, screenshot it and record what was expected / seen. Never raises for a page's failure: an
    error while checking a page is recorded as that page's failed expectation."""
    rest = Rest(server.url)
    base = server.url + "/"
    pages: list[PageReport] = []
    header: list[str] = [f"- Project: `{project}`", f"- Server: `mlflow {' '.join(server.command()[3:])}`"]

    def section(rep: PageReport, fn) -> None:
        pages.append(rep)
        try:
            fn(rep)
        except Exception as e:  # noqa: BLE001 - a broken page is a finding, the other pages still get checked
            rep.expect("the page to be checked without error", False, f"{type(e).__name__}: {str(e)[:300]}")

    # ---- data, from the REST API ----------------------------------------------------------------------------------
    experiments = rest.experiments()
    runs_by_exp = {e["experiment_id"]: rest.runs(e["experiment_id"]) for e in experiments}
    exp = max(experiments, key=lambda e: len(runs_by_exp[e["experiment_id"]]))
    exp_id, exp_name, runs = exp["experiment_id"], exp["name"], runs_by_exp[exp["experiment_id"]]
    kind = tags_of(exp).get("mlflow.experimentKind", "(unset)")
    header.append(f"- Experiment: `{exp_name}` (id {exp_id}, {len(runs)} runs, `mlflow.experimentKind={kind}`); all: "
                  + ", ".join(f"`{e['name']}` ({len(runs_by_exp[e['experiment_id']])} runs)" for e in experiments))
    children_of: dict[str, list[dict]] = {}
    for r in runs:
        if "mlflow.parentRunId" in tags_of(r):
            children_of.setdefault(tags_of(r)["mlflow.parentRunId"], []).append(r)
    # runs/search returns the newest first; the parent shown is the one with the most child runs (a full `kedro run`).
    parents = [r for r in runs if "mlflow.parentRunId" not in tags_of(r) and r["info"]["run_id"] in children_of]
    parents.sort(key=lambda r: -len(children_of[r["info"]["run_id"]]))
    # Artifact locations are absolute file:// URIs recorded at run time: a moved / copied project still points at the
    # old place (the UI then shows that folder's artifacts, or none if it is gone).
    local = [(r, Path(urllib.parse.urlparse(r["info"].get("artifact_uri", "")).path)) for r in runs
             if r["info"].get("artifact_uri", "").startswith("file:")]
    outside = [uri for _, uri in local if not uri.is_relative_to(project)]
    gone = [uri for _, uri in local if not uri.parent.parent.exists()]  # <root>/<run_id>/artifacts: root missing
    if outside:
        header.append(f"- Note: {len(outside)} run(s) record artifact locations outside the project (e.g. "
                      f"`{outside[0]}`): the UI shows the artifacts of that place.")
    if gone:
        header.append(f"- Note: {len(gone)} run(s) record artifact locations whose root folder is missing (e.g. "
                      f"`{gone[0]}`): the UI cannot show their artifacts.")

    # ---- a. experiments list -------------------------------------------------------------------------------------
    def experiments_list(rep: PageReport) -> None:
        rep.url = base + "#/experiments"
        page = browser.open(rep.url, rep)
        ok = browser.visible(page, exp_name, exact=True)
        rep.screenshot = browser.shot(page, "a1_experiments_list")
        rep.expect(f"experiment `{exp_name}` listed", ok, "listed" if ok else body_text(page))
        assistant = browser.visible(page, "MLflow Assistant", timeout_ms=1000)
        if assistant:
            # It opens by itself on a first visit and takes a third of the width: close it as a user would (the
            # profile remembers), so the next screenshots show the pages at full width.
            page.get_by_role("button", name="Close", exact=True).last.click()
            rep.facts.append("the 'MLflow Assistant' side panel opened by itself on this first visit (shown in the "
                             "screenshot); closed it for the next pages")
        page.close()

    section(PageReport("a. Experiments list"), experiments_list)

    # ---- e. the experiment page as a first-time user lands on it, then a. its runs table ---------------------------
    newest_parent = run_name(parents[0]) if parents else (run_name(runs[0]) if runs else "")

    def experiment_page(rep: PageReport) -> None:
        rep.url = base + f"#/experiments/{exp_id}"
        page = browser.open(rep.url, dismiss=False)  # the screenshot shows the page exactly as a first visit lands
        browser.visible(page, exp_name, on_screen=False)
        landed = page.url.split("#", 1)[-1]
        rep.screenshot = browser.shot(page, "e_experiment_default_view")
        genai = [t for t in ("Traces", "Sessions", "Judges", "Evaluation runs", "Usage", "Tool calls")
                 if browser.visible(page, t, timeout_ms=300, exact=True, on_screen=False)]
        switch = "GenAI" if "workflowType=genai" in landed else ("Model training" if "machine_learning" in landed
                                                                  else "(no workflowType in the route)")
        rep.facts.append(f"landed on `#{landed}`; the header's GenAI / Model training switch is on {switch}; "
                         f"GenAI labels visible: {', '.join(genai) or 'none'}")
        for title in browser.dismiss_dialogs(page):
            rep.facts.append(f"a first-visit pop-up '{title}' covers the page (in the screenshot)")
        route = landed.split("?", 1)[0]
        bare_on_runs = route.rstrip("/").endswith("/runs")
        rep.facts.append(f"the bare link `#/experiments/{exp_id}` opens on `#{route}`"
                         + (f" (GenAI: {', '.join(genai[:3])})" if genai else "")
                         + ": in MLflow 3.17 the header's GenAI / Model training switch (a browser setting, GenAI "
                         "by default) decides the view, not the experiment's `mlflow.experimentKind` tag")
        page.close()
        # the link the README gives: the runs table, whatever the browser's switch says
        documented = base + f"#/experiments/{exp_id}?workflowType=machine_learning"
        page = browser.open(documented, rep)
        landed = page.url.split("#", 1)[-1].split("?", 1)[0]
        on_runs = landed.rstrip("/").endswith("/runs") and browser.visible(page, newest_parent, timeout_ms=5000)
        rep.facts.append(f"screenshot of the README's link: `{browser.shot(page, 'e_experiment_documented_link')}`")
        rep.expect(f"the README's link `#/experiments/{exp_id}?workflowType=machine_learning` opens the runs table "
                   "(model training view)", on_runs,
                   f"opens on `#{landed}`" + ("" if on_runs else f"; page text: {body_text(page)}"))
        if bare_on_runs:
            rep.facts.append("the bare link opened the runs table too")
        page.close()

    section(PageReport("e. Experiment page: the view it opens on"), experiment_page)

    def runs_table(rep: PageReport) -> None:
        rep.url = base + f"#/experiments/{exp_id}"
        page = browser.open(rep.url, rep)
        switched = ""
        toggle = page.get_by_text("Model training", exact=True)
        if not page.url.split("#", 1)[-1].split("?", 1)[0].rstrip("/").endswith("/runs") and toggle.count():
            # What a user does to get the runs table: switch the header to "Model training" (the profile keeps it).
            toggle.first.click()
            browser.settle(page)
            switched = " after clicking the header's 'Model training' switch"
        rep.url = page.url
        ok = browser.visible(page, newest_parent, exact=True)
        rep.screenshot = browser.shot(page, "a2_experiment_runs_table")
        rep.expect(f"the runs table{switched}, with run `{newest_parent}`", ok,
                   "shown" if ok else f"not shown; page text: {body_text(page)}")
        shown = [r for r in runs if "mlflow.parentRunId" not in tags_of(r)
                 and browser.visible(page, run_name(r), timeout_ms=100, exact=True)]
        rep.facts.append(f"{len(shown)} of {sum('mlflow.parentRunId' not in tags_of(r) for r in runs)} top-level runs "
                         "visible without scrolling (child runs are folded under their parent)")
        page.close()

    section(PageReport("a. Experiment runs table"), runs_table)

    # ---- b. parent run -------------------------------------------------------------------------------------------
    def parent_run(rep: PageReport) -> None:
        for p in parents:
            params = {x["key"] for x in p["data"].get("params", [])}
            rep.facts.append(f"parent `{run_name(p)}`: {len(children_of[p['info']['run_id']])} child runs, "
                             f"{len(params)} params, `{PARENT_PARAM}` "
                             + ("present" if PARENT_PARAM in params else "ABSENT"))
        if not rep.expect("a parent run (no `mlflow.parentRunId`, with child runs)", bool(parents),
                          f"{len(parents)} among {len(runs)} runs"):
            return
        parent = parents[0]
        pid = parent["info"]["run_id"]
        params = {x["key"]: x["value"] for x in parent["data"].get("params", [])}
        rep.expect(f"`{PARENT_PARAM}` among the params of `{run_name(parent)}` (REST)", PARENT_PARAM in params,
                   f"{PARENT_PARAM}={params[PARENT_PARAM]}" if PARENT_PARAM in params
                   else f"absent ({len(params)} params)")
        rep.url = base + f"#/experiments/{exp_id}/runs/{pid}"
        page = browser.open(rep.url, rep)
        title_ok = browser.visible(page, run_name(parent), exact=True)
        header_text = page.get_by_text("Parameters (", exact=False)
        if header_text.count():
            rep.facts.append(f"the page's parameter table header reads `{header_text.first.inner_text().strip()}`")
        seen = browser.visible(page, PARENT_PARAM, timeout_ms=2000, exact=True)
        how = "in the Parameters table as it opens (scrolled to it)"
        box = page.get_by_placeholder("Search parameters")
        if box.count():
            # Long parameter tables scroll inside their box; filter them like a user would, for the screenshot too.
            box.first.fill(PARENT_PARAM)
            browser.settle(page)
            seen_filtered = browser.visible(page, PARENT_PARAM, timeout_ms=5000, exact=True)
            if not seen:
                seen, how = seen_filtered, "only after typing it into 'Search parameters'"
            box.first.scroll_into_view_if_needed()
        rep.screenshot = browser.shot(page, "b_parent_run")
        rep.expect("the run page titled with the run name", title_ok, "shown" if title_ok else body_text(page))
        rep.expect(f"parameter `{PARENT_PARAM}` visible", seen,
                   how if seen else f"not visible; page: {body_text(page)}")
        page.close()

    section(PageReport("b. Parent run"), parent_run)

    # ---- c. DPO child run, model metrics -------------------------------------------------------------------------
    def dpo_child(rep: PageReport) -> None:
        dpo = [r for r in runs if run_name(r).startswith("train_dpo") and "mlflow.parentRunId" in tags_of(r)]
        if not rep.expect("a child run named `train_dpo*`", bool(dpo), f"{len(dpo)} among {len(runs)} runs"):
            return
        in_parent = [r for r in dpo if parents and tags_of(r)["mlflow.parentRunId"] == parents[0]["info"]["run_id"]]
        child = (in_parent or dpo)[0]
        cid = child["info"]["run_id"]
        keys = sorted({m["key"] for m in child["data"].get("metrics", [])})
        loss = rest.metric_history(cid, "loss") if "loss" in keys else []
        steps = sorted({m.get("step", 0) for m in loss})
        rep.facts.append(f"run `{run_name(child)}` ({cid}), child of `{run_name(parents[0]) if in_parent else '?'}`")
        rep.facts.append(f"`loss` history: {len(loss)} point(s)"
                         + (f", steps {steps[0]}..{steps[-1]}" if steps else ""))
        rep.facts.append(f"metric keys ({len(keys)}): " + ", ".join(f"`{k}`" for k in keys))
        for r in dpo:
            if r is not child:
                n = len(rest.metric_history(r["info"]["run_id"], "loss"))
                rep.facts.append(f"other DPO run `{run_name(r)}`: `loss` history {n} point(s)")
        rep.expect("a `loss` metric history of more than one point (REST)", len(loss) > 1, f"{len(loss)} point(s)")
        if 1 < len(loss) < FEW_POINTS:
            rep.facts.append(f"FINDING: the `loss` curve has only {len(loss)} points: a coarse chart to read")
        rep.url = base + f"#/experiments/{exp_id}/runs/{cid}/model-metrics"
        page = browser.open(rep.url, rep)
        rep.screenshot = browser.shot(page, "c_dpo_child_model_metrics")  # as it opens: the TRL-named groups first
        for group, title in (("rewards", "margins"), ("rewards", "accuracies"), ("logps", "chosen")):
            ok = browser.visible(page, title, timeout_ms=5000, exact=True, on_screen=False)
            rep.expect(f"a chart `{title}` in the `{group}` group (TRL's `{group}/{title}`)", ok,
                       "shown" if ok else f"not shown; page text: {body_text(page)}")
        box = page.get_by_placeholder("Search metric charts")
        if box.count():  # the plain `loss` chart sits below the groups: find it as a user would
            box.first.fill("loss")
            browser.settle(page)
        chart = browser.visible(page, "loss", exact=True)
        browser.shot(page, "c_dpo_child_loss_chart")
        rep.expect("a chart titled `loss` on the Model metrics tab (searched for `loss`)", chart,
                   "shown" if chart else f"not shown; page text: {body_text(page)}")
        count = page.get_by_text("Model metrics (", exact=False)
        if count.count():
            rep.facts.append(f"the tab's section header reads `{count.first.inner_text().strip()}`")
        page.close()

    section(PageReport("c. DPO training child run: model metrics"), dpo_child)

    # ---- d. registered models ------------------------------------------------------------------------------------
    models = rest.registered_models()
    policies = sorted((m for m in models if m["name"].endswith("_policy_hf")),
                      key=lambda m: (m["name"] != "dpo_policy_hf", m["name"]))
    champions = [m for m in policies if CHAMPION in {a["alias"] for a in m.get("aliases", [])}]

    def models_list(rep: PageReport) -> None:
        rep.url = base + "#/models"
        page = browser.open(rep.url, rep)
        names = [m["name"] for m in models]
        rep.facts.append(f"registered models ({len(names)}): " + (", ".join(f"`{n}`" for n in names) or "none"))
        for m in models:
            if m.get("aliases"):
                rep.facts.append(f"`{m['name']}` aliases: "
                                 + ", ".join(f"`{a['alias']}` → v{a['version']}" for a in m["aliases"]))
        shown = [n for n in names if browser.visible(page, n, timeout_ms=5000, exact=True)]
        alias_col = browser.visible(page, CHAMPION, timeout_ms=3000) if champions else None
        rep.screenshot = browser.shot(page, "d1_models_list")
        if alias_col is not None:
            rep.expect(f"alias `{CHAMPION}` visible in the list's 'Aliased versions'", alias_col,
                       "shown" if alias_col else "not shown")
        page.close()
        if not models:
            rep.facts.append("FINDING: no registered model in this store "
                             "(`kedro run --pipelines export` registers them)")
            return
        rep.expect("every registered model listed", len(shown) == len(names), f"{len(shown)}/{len(names)} listed")
        rep.expect(f"a `*_policy_hf` model with the alias `{CHAMPION}` (REST)", bool(champions),
                   ", ".join(m["name"] for m in champions) or f"none of {[m['name'] for m in policies]}")

    section(PageReport("d. Registered models"), models_list)

    def model_pages(model: dict) -> None:
        name = model["name"]
        aliases = {a["alias"]: a["version"] for a in model.get("aliases", [])}
        versions = rest.model_versions(name)

        def model_page(rep: PageReport) -> None:
            rep.facts.append(f"{len(versions)} version(s); aliases: "
                             + (", ".join(f"`{a}` → v{v}" for a, v in aliases.items()) or "none"))
            rep.url = base + f"#/models/{urllib.parse.quote(name)}"
            page = browser.open(rep.url, rep)
            ok = browser.visible(page, name, exact=True)
            chip = browser.visible(page, CHAMPION, timeout_ms=3000) if CHAMPION in aliases else None
            rep.screenshot = browser.shot(page, f"d2_model_{name}")
            rep.expect("the model page with the model's name", ok, "shown" if ok else body_text(page))
            if chip is not None:
                rep.expect(f"alias `{CHAMPION}` visible", chip, "shown" if chip else f"not shown: {body_text(page)}")
            page.close()

        section(PageReport(f"d. Model `{name}`"), model_page)
        if not versions:
            return
        version = aliases.get(CHAMPION) or max(versions, key=lambda v: int(v["version"]))["version"]
        vinfo = next(v for v in versions if v["version"] == version)
        vtags = tags_of(vinfo)

        def version_page(rep: PageReport) -> None:
            rep.facts.append("version tags: " + (", ".join(f"`{k}={v}`" for k, v in sorted(vtags.items())) or "none"))
            rep.facts.append(f"source `{vinfo.get('source', '')}`, status {vinfo.get('status', '')}")
            rep.url = base + f"#/models/{urllib.parse.quote(name)}/versions/{version}"
            page = browser.open(rep.url, rep)
            browser.visible(page, f"Version {version}")
            if CHAMPION in aliases:
                ok = browser.visible(page, CHAMPION, timeout_ms=5000)
                rep.expect(f"alias `{CHAMPION}` visible", ok, "shown" if ok else f"not shown: {body_text(page)}")
            for tag in VERSION_TAGS:
                ok = browser.visible(page, tag, timeout_ms=3000, exact=True)
                rep.expect(f"version tag `{tag}` visible", ok,
                           f"shown (`{vtags.get(tag, '')}`)" if ok else
                           f"not shown; the version {'has' if tag in vtags else 'has no'} such tag (REST)")
            rep.screenshot = browser.shot(page, f"d3_model_{name}_v{version}")
            page.close()

        what = f"alias `{CHAMPION}`" if CHAMPION in aliases else f"latest; no `{CHAMPION}` alias"
        section(PageReport(f"d. Model `{name}` version {version} ({what})"), version_page)

    # The DPO policy (else the first policy), and the champion's model when it is another one.
    for model in ([policies[0]] if policies else []) + [m for m in champions if not policies or m is not policies[0]]:
        model_pages(model)

    if browser.blocked:
        header.append("- Requests to other hosts aborted (no network here): " + ", ".join(sorted(browser.blocked)))
    return header, pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="Kedro project folder holding mlflow.db (and mlruns/)")
    ap.add_argument("--out", required=True, type=Path, help="folder for the PNGs and findings.md")
    ap.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each page's expected text")
    args = ap.parse_args(argv)

    project = args.project.resolve()
    if not (project / "mlflow.db").is_file():
        print(f"FAIL setup: no {project / 'mlflow.db'}", file=sys.stderr)
        return 1
    if not Path(CHROMIUM).exists():
        print(f"FAIL setup: {CHROMIUM} missing (apt-get install -y chromium)", file=sys.stderr)
        return 1
    try:
        import playwright  # noqa: F401
    except ImportError:
        print("FAIL setup: the playwright package is missing (pip install playwright)", file=sys.stderr)
        return 1
    if args.port is not None and not port_is_free(args.port):
        print(f"FAIL setup: port {args.port} on 127.0.0.1 is in use (leave --port out to get a free one)",
              file=sys.stderr)
        return 1
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="mlflow_ui_check_"))
    try:
        with MlflowServer(project, args.port or free_port(), scratch) as server:
            browser = Browser(out, scratch / "chromium-profile", server.url, int(args.timeout * 1000))
            try:
                header, pages = check_ui(server, browser, project)
            finally:
                browser.close()
            if browser.console_errors:
                distinct = sorted({e.split(": ", 1)[-1] for e in browser.console_errors})
                header.append(f"- Browser console errors: {len(browser.console_errors)}; distinct: "
                              + "; ".join(f"`{e}`" for e in distinct[:3]) + (" …" if len(distinct) > 3 else ""))
            if browser.http_errors:
                failed = ", ".join(f"`{e}`" for e in sorted(browser.http_errors))
                header.append(f"- Failed requests of the app: {failed}")
    except Exception as e:  # noqa: BLE001 - server start, REST or browser launch: one clear line, exit 1
        print(f"FAIL setup: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if (scratch / "mlflow_server.log").exists():
            shutil.copy2(scratch / "mlflow_server.log", out / "mlflow_server.log")
        shutil.rmtree(scratch, ignore_errors=True)

    findings = write_findings(out, header, pages)
    failed = [(p, c) for p in pages for c in p.failed]
    for p, c in failed:
        print(f"FAIL {p.name}: expected {c.expected} — seen: {c.seen}")
    print(f"{'FAIL' if failed else 'PASS'}: {len(failed)} failed expectation(s); findings in {findings}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
