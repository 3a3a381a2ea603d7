from gpuctl.cli import main

main()
