'use strict';
/*
 * completer.js: finish the orders whose service process died between the
 * steps.  It listens for the sweep's notification that keys of the scope
 * 'orders' were abandoned (their lease ended), takes them over, and runs the
 * same placeOrder() as the route, from the key's last checkpoint with the
 * request the claim kept; the response it stores is what the client's retry
 * gets.  SIGTERM stops it once the orders it is finishing are done.
 *
 *   PGHOST=... PGDATABASE=... PROVIDER_URL=http://127.0.0.1:4000 node src/completer.js
 *
 * Settings (environment): PROVIDER_URL; LISTEN_URL, a connection string that
 * reaches PostgreSQL directly, for the LISTEN connection (default: the libpq
 * variables, like the pool's) -- when the pool goes through PgBouncer in
 * transaction mode, notifications do not: the work goes through the pooler,
 * the LISTEN connection must not; IDEM_LEASE (seconds, default 30);
 * CONCURRENCY (default 4); POLL_INTERVAL (seconds, default 60: the fallback
 * when a notification is missed); EXIT_WITH_STDIN=1 as in server.js.
 */

const { Pool } = require('pg');
const { completer } = require('pg-idempotency');
const { placeOrder } = require('./orders');
const { SCOPE } = require('./app');

const pool = new Pool({ max: 10 });
pool.on('error', (err) => console.error('idle database connection failed', err));
const providerUrl = process.env.PROVIDER_URL ?? 'http://127.0.0.1:4000';

const orders = completer({
	pool,
	scope: SCOPE,
	kind: 'http',
	concurrency: Number(process.env.CONCURRENCY ?? 4),
	lease: Number(process.env.IDEM_LEASE ?? 30),
	pollInterval: Number(process.env.POLL_INTERVAL ?? 60),
	...(process.env.LISTEN_URL ? { listenClient: process.env.LISTEN_URL } : {}),
	/* the kept request is { method, path, body }: the order is its body */
	handler: async (attempt) => ({
		status: 201,
		body: await placeOrder(attempt, attempt.request.body, { providerUrl }),
	}),
	onClaim: ({ key, attempt, phase }) => console.log(`TAKEN OVER ${key} attempt ${attempt} from ${phase ?? 'the start'}`),
	onFinish: ({ key, status, error }) => console.log(`FINISHED ${key} ${status}${error ? `: ${error.message}` : ''}`),
});

async function main() {
	await orders.start();
	console.log(`completer listening for abandoned orders (scope ${SCOPE}, LISTEN ${orders.listening ? 'up' : 'down: polling'})`);
}

async function shutdown() {
	await orders.stop();
	await pool.end();
	process.exit(0);
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);

if (process.env.EXIT_WITH_STDIN === '1') {
	process.stdin.on('end', () => process.exit(1));
	process.stdin.resume();
}

main().catch((err) => {
	console.error(err);
	process.exit(1);
});
