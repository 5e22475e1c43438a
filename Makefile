# Local and GPU-box shortcuts. `make test` runs exactly the README's test command; without a GPU the
# Triton kernels run under the interpreter (TRITON_INTERPRET=1).
PYTHON ?= python
TEST_CMD = $(PYTHON) -m pytest tests notebooks --nbmake -q
HAS_GPU = $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"

.PHONY: install test notebooks lint

install:
	$(PYTHON) -m pip install -r requirements-ci.txt

test:
	@if $(HAS_GPU); then \
		echo "GPU found: $(TEST_CMD)"; $(TEST_CMD); \
	else \
		echo "no GPU: TRITON_INTERPRET=1 $(TEST_CMD)"; TRITON_INTERPRET=1 MPLBACKEND=Agg $(TEST_CMD); \
	fi

notebooks:
	$(PYTHON) scripts/run_notebooks.py

lint:
	$(PYTHON) -m ruff check kernels benchmarks notebooks tests scripts
