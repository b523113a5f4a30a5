"""The jars resolved from Maven Central with `mvn`: Spark's Kafka source, which every stage job
needs, the Kafka broker, which the local stack (kafka2pg.devtools) runs, and a Kafka Connect worker
with the Debezium JDBC sink, the benchmark's Kafka Connect contender (bench/compare.py).

Set-up (`kafka2pg stack install`) resolves the broker's and Spark's once under the state directory's
`jars/`, and Connect's too with `--bench` (`./kafka2pg setup` and `./kafka2pg test` ask for it; the
benchmark resolves it itself when missing); the DAG's spark-submit finds Spark's there
(`spark_kafka_source`). Later calls are offline.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import tarfile
from importlib import metadata
from pathlib import Path

from kafka2pg.exceptions import StackError
from kafka2pg.locations import CHECKOUT, PACKAGE_DIR, default_state_dir, state_dir

log = logging.getLogger(__name__)

MAVEN_DIR = PACKAGE_DIR / "maven"
DEFAULT_CACHE = default_state_dir()
# name under jars/ -> the POM that lists them
POMS = {"kafka": "kafka-broker.pom.xml", "spark": "spark-kafka.pom.xml", "connect": "kafka-connect.pom.xml"}


def jar_dir(cache: Path, name: str) -> Path:
    return cache / "jars" / name


# What set-up resolves for every command; "connect" only for the benchmark (`stack install --bench`).
SET_UP = ("kafka", "spark")


def resolve_jars(cache: Path | None = None, names: tuple[str, ...] = SET_UP) -> dict[str, Path]:
    """Resolve the jars of the named POMs once (under `cache`, by default the state directory,
    KAFKA2PG_STATE_DIR); later calls are offline."""
    cache = state_dir() if cache is None else cache
    result = {}
    for name in names:
        pom = POMS[name]
        target = jar_dir(cache, name)
        marker = target / ".complete"
        pom_path = MAVEN_DIR / pom
        pom_text = pom_path.read_text()
        versions = _versions(name, pom_text)
        made_from = pom_text + "".join(f"\n<!-- -D{k}={v} -->" for k, v in versions.items())
        if marker.exists() and marker.read_text() == made_from:
            result[name] = target
            continue
        # Resolved beside the jars in use, which are replaced only once Maven has succeeded.
        fresh = target.with_name(f".{target.name}.resolving")
        if _made_from(fresh) == made_from:  # resolved, then stopped before it replaced them
            _replace(target, fresh)
            result[name] = target
            continue
        if shutil.which("mvn") is None:
            setup = ", or run `./kafka2pg setup`" if CHECKOUT else ""
            raise StackError(f"Maven (mvn) is not installed: `apt-get install maven`{setup}")
        shutil.rmtree(fresh, ignore_errors=True)
        settings = os.environ.get("KAFKA2PG_MAVEN_SETTINGS", str(MAVEN_DIR / "settings.xml"))
        command = [
            "mvn",
            "-B",
            "-q",
            "-s",
            settings,
            "-f",
            str(pom_path),
            # pinned: an unqualified goal asks Maven Central which version is the latest each time
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            f"-DoutputDirectory={fresh}",
            "-DincludeScope=runtime",
            *(f"-D{k}={v}" for k, v in versions.items()),
        ]
        log.info("resolving %s jars from Maven Central into %s", name, target)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise StackError(f"Maven could not resolve {pom}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        fresh.mkdir(parents=True, exist_ok=True)  # a POM without dependencies makes no folder
        _unpack_plugins(fresh)
        (fresh / ".complete").write_text(made_from)
        _replace(target, fresh)
        result[name] = target
    return result


def _made_from(folder: Path) -> str | None:
    marker = folder / ".complete"
    return marker.read_text() if marker.is_file() else None


def _replace(target: Path, fresh: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    fresh.rename(target)


DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


def _versions(name: str, pom_text: str) -> dict[str, str]:
    """The POM properties to set from what is installed: Spark's Kafka source must be the build of
    the pyspark this environment runs (a pip-installed kafka2pg may sit beside another pyspark
    than the pinned one), and jars resolved for another pyspark are resolved again. None when the
    POM names the installed version already (jars resolved before are then still in use)."""
    if name != "spark":
        return {}
    installed = metadata.version("pyspark")
    if f"<spark.version>{installed}</spark.version>" in pom_text:
        return {}
    return {"spark.version": installed}


def connect_plugin_path(jars: Path) -> Path:
    """The Kafka Connect `plugin.path` folder: one sub-folder per connector archive."""
    return jars / "plugins"


def _unpack_plugins(target: Path) -> None:
    """A connector comes as a plugin archive (tar.gz of its jars); Connect loads it unpacked, each in
    its own class loader, so its jars stay off the worker's class path."""
    for archive in sorted(target.glob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(connect_plugin_path(target), filter="data")
        archive.unlink()


def spark_jars(cache: Path | None = None) -> list[Path]:
    """The Kafka source jars Spark lacks (those pyspark already ships are left out)."""
    import pyspark

    shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    jars = resolve_jars(cache)["spark"]
    return sorted(p for p in jars.glob("*.jar") if _artifact(p.name) not in shipped)


def spark_kafka_source() -> tuple[str | None, dict[str, str]]:
    """How a stage job gets Spark's Kafka source, as (`--jars`, Spark conf): KAFKA2PG_SPARK_JARS
    (comma-separated jars or globs); else the jars set-up resolved (`kafka2pg stack install`) under the
    state directory; else `spark.jars.packages`, the official package matching the installed pyspark,
    which Spark resolves from Maven Central when the job starts. A pipeline's spark_conf wins over it."""
    if os.environ.get("KAFKA2PG_SPARK_JARS"):
        return os.environ["KAFKA2PG_SPARK_JARS"], {}
    resolved = state_dir() / "jars" / "spark" / "*.jar"
    if glob.glob(str(resolved)):
        return str(resolved), {}
    package = f"org.apache.spark:spark-sql-kafka-0-10_2.13:{metadata.version('pyspark')}"
    return None, {"spark.jars.packages": package}


def _artifact(jar_name: str) -> str:
    stem = jar_name.removesuffix(".jar")
    parts = stem.split("-")
    while parts and parts[-1][:1].isdigit():
        parts.pop()
    return "-".join(parts)
