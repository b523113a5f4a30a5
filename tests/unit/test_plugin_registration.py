"""The Airflow plugin as Airflow's plugin loader finds it: from the plugins folder and from the
wheel's entry point, with a mounted app and a nav entry Airflow accepts, and no heavy import."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from airflow._shared.plugins_manager import _load_plugins_from_plugin_directory
from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse
plugins, errors = _load_plugins_from_plugin_directory(sys.argv[1])
(plugin,) = [p for p in plugins if p.name == "kafka2pg"]
views = [ExternalViewResponse(**v).model_dump() for v in plugin.external_views]
heavy = sorted(m for m in ("pyspark", "psycopg", "great_expectations", "confluent_kafka") if m in sys.modules)
print(json.dumps({
    "errors": errors,
    "names": sorted(p.name for p in plugins),
    "class": f"{type(plugin).__module__}.{type(plugin).__qualname__}",
    "apps": [{k: v for k, v in a.items() if k != "app"} for a in plugin.fastapi_apps],
    "routes": sorted(r.path for r in plugin.fastapi_apps[0]["app"].routes if "{" in r.path or r.path == "/"),
    "views": views,
    "heavy": heavy,
}))
"""


def test_the_plugins_folder_yields_one_kafka2pg_plugin_with_its_app_and_nav_entry():
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "plugins")],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin", "AIRFLOW__CORE__LOAD_EXAMPLES": "False"},
        timeout=300,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["errors"] == {} and found["names"] == ["kafka2pg"], "the package's own modules are not plugins"
    assert found["class"] == "kafka2pg.airflow_plugin.Kafka2PgPlugin"
    assert found["apps"] == [{"url_prefix": "/kafka2pg", "name": "kafka2pg"}]
    assert found["routes"] == [
        "/",
        "/pipelines/{name}/batches",
        "/pipelines/{name}/batches/{batch_id}/quarantine",
        "/pipelines/{name}/batches/{batch_id}/report",
        "/pipelines/{name}/history",
    ]
    (view,) = found["views"]
    assert (view["name"], view["href"], view["destination"], view["url_route"]) == (
        "kafka2pg",
        "/kafka2pg/",
        "nav",
        "kafka2pg",
    )
    assert found["heavy"] == [], "Airflow loads plugins in every component: no client import at load"


def test_the_wheel_registers_the_same_plugin_through_its_entry_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["airflow.plugins"] == {"kafka2pg": "kafka2pg.airflow_plugin:Kafka2PgPlugin"}
