.PHONY: install run test lint protos bench

install:
	bash scripts/install.sh

# The main job: a local P/D cluster on the embedded default model, answering a request.
run: install
	pdserve up --demo

test: install
	bash scripts/test.sh

lint:
	ruff check .

protos:
	python3 scripts/gen_protos.py
