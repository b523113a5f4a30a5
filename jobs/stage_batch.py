"""spark-submit entry point as a file of the checkout; the job is `kafka2pg.stage_job` (whose file,
inside the installed package, is what the DAG submits).

Usage: spark-submit jobs/stage_batch.py --pipeline NAME --batch-id N [--epoch E] [--batches K
--run-id ID --max-records-per-batch M]
"""

import sys
from pathlib import Path

# Run from the checkout, the package is imported from plugins/ (installed, from site-packages).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))

from kafka2pg.stage_job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
