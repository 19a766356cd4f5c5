-- row 7 bound: the least durable work any 2-commit claim + finish can do:
-- two transactions, each one single-row INSERT into an unindexed table
\set k random(1, 1000000000000000000)
INSERT INTO bench.commit_probe VALUES (:k);
INSERT INTO bench.commit_probe VALUES (:k);
