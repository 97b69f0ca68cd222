"""The parts of ``hrt-serve``, which :mod:`hrt_runtime.serve` puts together (its docstring says
what the service does):

* :mod:`.admitted`: one admitted request and the exceptions a request is answered with;
* :mod:`.batching`: which waiting requests a free worker takes into one batch;
* :mod:`.batcher`: admission by work, the queue, the worker threads and the drain;
* :mod:`.body`: a ``POST /translate`` body read and checked, before any work;
* :mod:`.parse`: a body's JSON parsed and its text checked (in a process of its own when big);
* :mod:`.intake`: a body parsed, checked and tokenised off the event loop, in bounded pools;
* :mod:`.listener`: the TCP site: its connection limit, HTTP parser errors as JSON;
* :mod:`.metrics`: the Prometheus series;
* :mod:`.handlers`: the HTTP handlers and the middleware that logs and counts every request.
"""
