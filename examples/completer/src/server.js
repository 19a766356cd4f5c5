'use strict';
/*
 * server.js: run the orders service.
 *
 *   PGHOST=... PGDATABASE=... PROVIDER_URL=http://127.0.0.1:4000 node src/server.js
 *
 * Settings (environment): PORT (default 3000; 0 picks a free port),
 * PROVIDER_URL, IDEM_LEASE (seconds, default 30), POOL_SIZE (default 10),
 * CRASH_AFTER=authorized (tests only: the process kills itself with SIGKILL
 * right after that checkpoint is stored, between the order's two steps),
 * EXIT_WITH_STDIN=1 (exit when stdin closes: the test harness's way to never
 * leave orphans).  The connection comes from the libpq variables: PGHOST,
 * PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGOPTIONS; through PgBouncer in
 * transaction mode is fine for the service.
 */

const { Pool } = require('pg');
const { createApp } = require('./app');

const pool = new Pool({ max: Number(process.env.POOL_SIZE ?? 10) });
pool.on('error', (err) => console.error('idle database connection failed', err));

const crashAfter = process.env.CRASH_AFTER ?? null;

const app = createApp({
	pool,
	providerUrl: process.env.PROVIDER_URL ?? 'http://127.0.0.1:4000',
	lease: Number(process.env.IDEM_LEASE ?? 30),
	/* a crash with nothing cleaned up: no release, no finish, the lease left to run out */
	afterCheckpoint: (phase) => {
		if (phase === crashAfter) {
			console.log(`CRASHING after ${phase}`);
			process.kill(process.pid, 'SIGKILL');
		}
	},
});

const server = app.listen(Number(process.env.PORT ?? 3000), '127.0.0.1', () => {
	/* the tests read this line to learn the port */
	console.log(`orders service listening on http://127.0.0.1:${server.address().port}`);
});

function shutdown() {
	server.close(() => pool.end().then(() => process.exit(0)));
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);

if (process.env.EXIT_WITH_STDIN === '1') {
	process.stdin.on('end', () => process.exit(1));
	process.stdin.resume();
}
