"""The parts of ``hrt-serve``, which :mod:`hrt_runtime.serve` puts together (its docstring says
what the service does):

* :mod:`.admitted`: one admitted request and the exceptions a request is answered with;
* :mod:`.batching`: which waiting requests start next as one batch;
* :mod:`.admission`: admission by work: the queue, the positions in flight, the shares;
* :mod:`.pace`: the service's measured pace, and the work refused as unable to finish;
* :mod:`.batcher`: the batches in progress, each in a thread, and the drain;
* :mod:`.turns`: the decoder passes of the batches in progress, ``--workers`` at once, the
  least work left first;
* :mod:`.body`: a ``POST /translate`` body read and checked, before any work;
* :mod:`.parse`: a body's JSON parsed and its text checked (in a process of its own when big);
* :mod:`.intake`: a body parsed, checked and tokenised off the event loop, in bounded pools;
* :mod:`.listener`: the TCP site: its connection limit, HTTP parser errors as JSON;
* :mod:`.metrics`: the Prometheus series;
* :mod:`.handlers`: the HTTP handlers and the middleware that logs and counts every request.
"""
