"""Put on a vLLM server's ``PYTHONPATH`` by ``LocalPD(cpu_isa=...)``: its ``sitecustomize``
makes the server compute as a CPU with fewer instruction sets would (``local._cpu_isa``)."""
