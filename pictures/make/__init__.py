"""What the pages show, made from real runs and checked against them.

- figures.py (`make figures`): every results .md written again from its
  .json, every measured figure on a page checked against the results file
  its section names, every quoted sample against its capture;
- samples.py (`make samples`): the sample outputs the pages quote
  (answers, `/stats`, log lines, engine traces), captured from real runs;
- pictures.py (`make traces`, `make pictures`): the engine's traces
  recorded into pictures/data/, and every PNG of pictures/ drawn from them;
  lora_products.py draws chapter 10's picture of one step's products.

Left out: measuring throughput or latency (bench/ does; these read its
results files).
"""
