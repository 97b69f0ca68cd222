from hrt_runtime.translator import cli_main

cli_main()
