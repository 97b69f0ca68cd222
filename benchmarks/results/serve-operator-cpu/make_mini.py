"""A random (untrained) HRT model of the quickstart's `mini` shape with a 4,000-word dictionary, exported."""
import os, sys, tempfile
sys.path.insert(0, os.environ["PYTHONPATH"])
import tests.hrt_fixtures as f
from fairseq_hrt.export.exporter import export_model

data = tempfile.mkdtemp(dir="/tmp/serve-work")
f.write_dictionary.__defaults__ = (4000,)
task, model = f.build_task_and_model(data, arch="hrt_mini", extra=("--chunk-sizes", "2"), seed=5)
export_model(model, task, sys.argv[1], restricted=False)
print(sum(p.numel() for p in model.parameters()))
