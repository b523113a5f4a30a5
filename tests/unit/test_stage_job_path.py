"""The stage job's driver imports PySpark from the installed package, not from the zip inside it
that spark-submit puts first on its path (kafka2pg_worker_daemon.skip_bundled_pyspark_zip)."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import pyspark

from kafka2pg.worker_daemon.kafka2pg_worker_daemon import skip_bundled_pyspark_zip


def _installed(site: Path) -> Path:
    """A pyspark package under `site` with its bundled zip; returns the zip."""
    package = site / "pyspark"
    (package / "python" / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    zipped = package / "python" / "lib" / "pyspark.zip"
    zipped.write_bytes(b"")
    return zipped


def test_the_installed_packages_own_zip_is_skipped(tmp_path):
    zipped = _installed(tmp_path / "site")
    py4j = str(zipped.parent / "py4j-0.10.9.9-src.zip")
    path = [str(zipped), py4j, "", str(tmp_path / "site")]
    assert skip_bundled_pyspark_zip(path) == [str(zipped)]
    assert path == [py4j, "", str(tmp_path / "site")]


def test_the_zip_stays_where_the_package_would_not_be_imported_without_it(tmp_path):
    zipped = _installed(tmp_path / "site")
    path = [str(zipped)]  # the package's directory is not on the path
    assert skip_bundled_pyspark_zip(path) == []
    assert path == [str(zipped)]
    other = tmp_path / "other" / "pyspark"  # another pyspark comes first once the zip is gone
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    path = [str(zipped), str(tmp_path / "other"), str(tmp_path / "site")]
    assert skip_bundled_pyspark_zip(path) == []
    assert len(path) == 3


def test_a_spark_installations_zip_stays(tmp_path):
    home = tmp_path / "spark-4.2.0-bin"
    (home / "python" / "lib").mkdir(parents=True)
    zipped = home / "python" / "lib" / "pyspark.zip"
    zipped.write_bytes(b"")
    site = tmp_path / "site"
    _installed(site)
    path = [str(zipped), str(site)]
    assert skip_bundled_pyspark_zip(path) == []


def test_with_the_real_installation_pyspark_comes_from_its_package():
    package = Path(pyspark.__file__).parent
    zipped = package / "python" / "lib" / "pyspark.zip"
    assert zipped.is_file(), "pip's pyspark ships python/lib/pyspark.zip"
    path = [str(zipped), str(package.parent)]
    assert skip_bundled_pyspark_zip(path) == [str(zipped)]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", path)
    assert Path(spec.origin) == package / "__init__.py"
