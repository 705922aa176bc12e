"""What the tests share and import: worker functions run on several processes, the model zoo, the subprocess and
cases runners, the fault suite's checks. A package beside the tests (``from helpers.zoo import ZOO``), importable
the same way in every process ``paratrain.testing.spawn`` starts, since those unpickle functions by module name."""
