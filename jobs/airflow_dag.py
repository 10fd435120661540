"""Airflow DAG: the English job mapped over 4 workers, then merged.

Each mapped task runs one worker (`--shard I/4`). A retry reruns the same command, which resumes
from the worker's checkpoint, so retries never redo or duplicate finished rows. Exit code 4
(interrupted, resumable) is a failure to Airflow, which is what makes it retry. The last stdout
line is a JSON summary that BashOperator pushes to XCom. Runs on Airflow 3 and on Airflow 2.
"""

from datetime import datetime, timedelta

try:
    from airflow.sdk import DAG  # Airflow 3
except ImportError:
    from airflow import DAG  # Airflow 2
try:
    from airflow.providers.standard.operators.bash import BashOperator  # Airflow 3 (the standard provider)
except ImportError:
    from airflow.operators.bash import BashOperator  # Airflow 2

WORKERS = 4
RUN = "cd /opt/cosybatch && cosybatch run --job jobs/english-piper-sharded.yaml --shard {index}/{count}"
MERGE = "cd /opt/cosybatch && cosybatch merge out/english-piper-sharded"

with DAG(
    dag_id="cosybatch_english",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    default_args={"retries": 5, "retry_delay": timedelta(minutes=2)},
) as dag:
    workers = BashOperator.partial(task_id="synthesise", execution_timeout=timedelta(hours=8)).expand(
        bash_command=[RUN.format(index=i, count=WORKERS) for i in range(WORKERS)]
    )
    merge = BashOperator(task_id="merge", bash_command=MERGE)
    workers >> merge
