from llmtrain.cli import main

main()
