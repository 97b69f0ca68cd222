from hrt_runtime.translate_command import cli_main

cli_main()
