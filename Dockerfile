# The image docker-compose.yaml builds for Airflow's components and for the Spark worker: the official
# slim Airflow image of requirements.txt's Airflow and Python 3.11, a JRE (spark-submit, the worker and
# its executors), and kafka2pg installed from this checkout as its wheel, with its dependencies at
# requirements.txt's pins (the installation tests/e2e/test_installed_wheel.py proves). The worker runs
# from this image so that its executors have the driver's Python and kafka2pg's runtime dependencies.
ARG AIRFLOW_VERSION=3.3.2

# Spark's Kafka source, resolved at build time from the same POM `kafka2pg stack install` uses: the
# stage job passes these to spark-submit (`--jars`, via KAFKA2PG_SPARK_JARS), so nothing is fetched from
# Maven Central when a job starts, and the executors get them from the driver.
FROM maven:3.9-eclipse-temurin-17 AS spark-jars
COPY plugins/kafka2pg/maven/spark-kafka.pom.xml /build/pom.xml
RUN mvn -B -q -f /build/pom.xml dependency:copy-dependencies -DoutputDirectory=/jars -DincludeScope=runtime

FROM apache/airflow:slim-${AIRFLOW_VERSION}-python3.11
ARG AIRFLOW_VERSION

USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && apt-get autoremove -yqq --purge \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*
USER airflow

COPY --from=spark-jars /jars /opt/kafka2pg/jars
ENV KAFKA2PG_SPARK_JARS=/opt/kafka2pg/jars/*.jar

COPY --chown=airflow:0 pyproject.toml README.md requirements.txt /tmp/kafka2pg/
COPY --chown=airflow:0 plugins/kafka2pg /tmp/kafka2pg/plugins/kafka2pg
COPY --chown=airflow:0 sql /tmp/kafka2pg/sql
# requirements.txt's pins as constraints (pip refuses extras there): the wheel's own dependencies decide
# what is installed, at the tested versions, and the dev tools are left out. Airflow stays at the
# image's version. The last line fails the build if the JRE or an import the executors need is missing.
RUN sed 's/\[[^]]*\]//g' /tmp/kafka2pg/requirements.txt > /tmp/kafka2pg/constraints.txt \
    && pip install --no-cache-dir -c /tmp/kafka2pg/constraints.txt "apache-airflow==${AIRFLOW_VERSION}" /tmp/kafka2pg \
    && rm -rf /tmp/kafka2pg \
    && java -version \
    && python -c "import kafka2pg.chunk_writer, kafka2pg.dag_factory, pyspark, yaml, confluent_kafka"
