"""Which sessions get kafka2pg's worker daemon (kafka2pg.staging.worker_daemon_conf)."""

from kafka2pg.staging import WORKER_DAEMON_DIR, worker_daemon_conf


def test_local_masters_get_it():
    for master in ("local", "local[2]", "local[*]", "local[4,2]"):
        assert worker_daemon_conf(master, {}) == {
            "spark.python.daemon.module": "kafka2pg_worker_daemon",
            "spark.executorEnv.PYTHONPATH": str(WORKER_DAEMON_DIR),
        }
    assert (WORKER_DAEMON_DIR / "kafka2pg_worker_daemon.py").is_file()


def test_cluster_masters_and_a_conf_of_ones_own_do_not():
    for master in ("spark://host:7077", "yarn", "k8s://https://api:6443", "local-cluster[2,1,1024]"):
        assert worker_daemon_conf(master, {}) == {}
    assert worker_daemon_conf("local[2]", {"spark.python.daemon.module": "mine"}) == {}
    assert worker_daemon_conf("local[2]", {"spark.executorEnv.PYTHONPATH": "/opt/lib"}) == {}


def test_without_a_master_or_a_running_jvm_it_stays_out(monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    from pyspark import SparkContext

    monkeypatch.setattr(SparkContext, "_gateway", None)
    assert worker_daemon_conf(None, {}) == {}
