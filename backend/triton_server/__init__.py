"""What the Triton models share (model_repository/*/1/model.py stay thin adapters over these):
request parsing (`request`), responses (`response`), metrics (`metrics`) and the file board
between the `llm` instances and the launcher (`control`). Plain Python and numpy, tested
without a server; `pb_utils` is only touched where Triton's stub provides it."""
