import sys
import time

from ._job import main
from ._sizing import process_seconds

sys.exit(main(started=time.perf_counter() - process_seconds()))   # imports count too
