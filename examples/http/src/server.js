'use strict';
/*
 * server.js: run the payments service.
 *
 *   PGHOST=... PGDATABASE=... DOWNSTREAM_URL=http://127.0.0.1:4000 node src/server.js
 *
 * Settings (environment): PORT (default 3000; 0 picks a free port),
 * DOWNSTREAM_URL, IDEM_LEASE (seconds, default 30), IDEM_RETENTION (seconds,
 * default 86400), IDEM_REMEMBER (seconds a payment's key is remembered after
 * its retention, default 2592000 = 30 days; needs the extension at 1.7 or
 * later; empty: the server's idempotency.remember), POOL_SIZE (default 10),
 * EXAMPLE_FAULTS=1 (honour X-Simulate-Failure; tests only: a checkout paused
 * after its charge prints "PAUSED charged <key>" and goes on at the next line
 * on stdin), EXIT_WITH_STDIN=1 (exit when stdin closes: the test harness's way
 * to never leave orphans).  The connection
 * comes from the usual libpq variables: PGHOST, PGPORT, PGUSER, PGDATABASE,
 * PGPASSWORD, PGOPTIONS.
 */

const readline = require('node:readline');
const { Pool } = require('pg');
const { createApp } = require('./app');

const pool = new Pool({ max: Number(process.env.POOL_SIZE ?? 10) });
pool.on('error', (err) => console.error('idle database connection failed', err));

const faults = process.env.EXAMPLE_FAULTS === '1';

/* tests only: hold a request at a point until the next line on stdin */
let pause;
if (faults) {
	const waiting = [];
	readline.createInterface({ input: process.stdin }).on('line', () => waiting.shift()?.());
	pause = (point, key) => new Promise((resolve) => {
		waiting.push(resolve);
		console.log(`PAUSED ${point} ${key}`);
	});
}

const app = createApp({
	pool,
	downstreamUrl: process.env.DOWNSTREAM_URL ?? 'http://127.0.0.1:4000',
	lease: Number(process.env.IDEM_LEASE ?? 30),
	retention: Number(process.env.IDEM_RETENTION ?? 86400),
	remember: process.env.IDEM_REMEMBER === '' ? null : Number(process.env.IDEM_REMEMBER ?? 2592000),
	faults,
	pause,
});

const server = app.listen(Number(process.env.PORT ?? 3000), '127.0.0.1', () => {
	/* the tests read this line to learn the port */
	console.log(`payments service listening on http://127.0.0.1:${server.address().port}`);
});

function shutdown() {
	server.close(() => pool.end().then(() => process.exit(0)));
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);

/* under a test harness: exit when the parent goes away (its end of stdin closes) */
if (process.env.EXIT_WITH_STDIN === '1') {
	process.stdin.on('end', () => process.exit(1));
	process.stdin.resume();
}
