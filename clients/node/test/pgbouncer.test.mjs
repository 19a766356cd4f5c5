// Through PgBouncer in transaction pooling mode (IDEM_PGBOUNCER_PORT, same
// host as PGHOST): claim and finish land on different server connections, the
// heartbeat goes through the pooler, and a waiting duplicate holds a server
// connection until the first request's answer is stored; a completer works
// through the pooler while its LISTEN connection reaches the server directly.
import { test, describe, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { idempotent, completer } from 'pg-idempotency';
import { db, row, newKey, deferred, waitFor, recordingPool, send, startExpress, createTestOrders } from './helpers.mjs';

const port = process.env.IDEM_PGBOUNCER_PORT;
const skip = port ? false : 'IDEM_PGBOUNCER_PORT is not set: no PgBouncer to test through';
const host = process.env.IDEM_PGBOUNCER_HOST ?? process.env.PGHOST;
const bouncer = port ? new pg.Pool({ host, port: Number(port), max: 8 }) : null;

after(async () => {
	await bouncer?.end();
	await db.end();
});

/*
 * Hold, in an open transaction through the pooler, the server connection
 * whose backend pid is `pid`; the pooler's other server connection is then
 * the only one left for the next statements.
 */
async function occupy(pid) {
	const a = new pg.Client({ host, port: Number(port) });
	const b = new pg.Client({ host, port: Number(port) });
	await a.connect();
	await b.connect();
	const pidOf = async (c) => {
		await c.query('BEGIN');
		return (await c.query('SELECT pg_backend_pid() AS pid')).rows[0].pid;
	};
	const pa = await pidOf(a);
	const pb = await pidOf(b);
	assert.ok([pa, pb].includes(pid), `the pooler's two server connections are ${pa} and ${pb}`);
	const [holder, other] = pa === pid ? [a, b] : [b, a];
	await other.query('COMMIT');
	await other.end();
	return async () => {
		await holder.query('COMMIT');
		await holder.end();
	};
}

describe('through PgBouncer (transaction pooling)', { skip }, () => {
	test('a job: claim and finish on different server connections, heartbeat through the pooler', async () => {
		const counted = recordingPool(bouncer);
		const key = newKey('pgb-job');
		const entered = deferred();
		const release = deferred();
		const job = idempotent(counted, { key, lease: 0.6 }, async () => {
			entered.resolve();
			await release.promise;
			return 'pooled';
		});
		await entered.promise;
		await waitFor(() => counted.log.filter((e) => e.kind === 'extend' && e.ok).length >= 4, 'heartbeats');
		const claimPid = counted.log.find((e) => e.kind === 'claim').pid;
		const free = await occupy(claimPid);
		try {
			release.resolve();
			const done = await job;
			assert.equal(done.attempt, 1);
		} finally {
			await free();
		}
		const finishPid = counted.log.find((e) => e.kind === 'finish').pid;
		assert.notEqual(finishPid, claimPid, 'claim and finish ran on different server connections');
		const r = await row(key);
		assert.equal(r.status, 'succeeded');
		assert.equal(r.attempt, 1);
		assert.deepEqual(r.response_body.json, 'pooled');
	});

	test('Express: claim and finish on different server connections; replay and the transactional mode work too', async () => {
		const counted = recordingPool(bouncer);
		const app = await startExpress({ pool: counted });
		try {
			await createTestOrders();
			const key = newKey('pgb-http');
			const gate = app.control.gate(key);
			const first = send(app.url, '/slow', { key });
			await gate.entered.promise;
			const claimPid = counted.log.find((e) => e.kind === 'claim').pid;
			const free = await occupy(claimPid);
			let done;
			try {
				gate.release.resolve();
				done = await first;
			} finally {
				await free();
			}
			assert.equal(done.status, 201, done.text);
			const finishPid = counted.log.find((e) => e.kind === 'finish').pid;
			assert.notEqual(finishPid, claimPid, 'claim and finish ran on different server connections');
			assert.equal((await row(key)).status, 'succeeded');
			const again = await send(app.url, '/slow', { key });
			assert.equal(again.headers['idempotent-replayed'], 'true');
			assert.deepEqual(again.bytes, done.bytes);

			const tx = newKey('pgb-tx');
			assert.equal((await send(app.url, '/tx', { key: tx, body: '{"note":"p"}' })).status, 201);
			assert.equal((await row(tx)).status, 'succeeded');
			assert.equal((await send(app.url, '/tx', { key: tx, body: '{"note":"p"}' })).headers['idempotent-replayed'], 'true');
		} finally {
			await app.close();
		}
	});

	test('Express with wait: a duplicate waits through the pooler and gets the first answer', async () => {
		const app = await startExpress({ pool: bouncer, wait: 30 });
		try {
			const key = newKey('pgb-wait');
			const gate = app.control.gate(key);
			const first = send(app.url, '/slow', { key });
			await gate.entered.promise;
			const duplicate = send(app.url, '/slow', { key });
			/* its claim waits on a server connection of the pooler */
			await waitFor(async () => (await db.query(`SELECT EXISTS (SELECT FROM pg_catalog.pg_stat_activity
				WHERE state = 'active' AND wait_event_type IN ('Extension', 'Lock', 'Timeout')
				  AND query LIKE '%idem_claim%') AS waiting`)).rows[0].waiting, 'the duplicate claim waiting');
			gate.release.resolve();
			const done = await first;
			const again = await duplicate;
			assert.equal(done.status, 201, done.text);
			assert.equal(again.status, 201, again.text);
			assert.equal(again.headers['idempotent-replayed'], 'true');
			assert.deepEqual(again.bytes, done.bytes);
			assert.equal((await row(key)).attempt, 1);
		} finally {
			await app.close();
		}
	});

	test('a completer: its work through the pooler, its LISTEN connection direct', async () => {
		const counted = recordingPool(bouncer);
		const scope = `pgb-completer-${randomUUID()}`;
		const key = newKey('pgb-abandoned');
		const c = completer({
			pool: counted, scope, pollInterval: 3600, lease: 0.6,
			/* the server itself (PGHOST, PGPORT), not the pooler */
			listenClient: { host: process.env.PGHOST, port: Number(process.env.PGPORT) },
			handler: async ({ attempt, request, phase }) => {
				await waitFor(() => counted.log.some((e) => e.kind === 'extend' && e.ok), 'a heartbeat through the pooler');
				return { attempt, request, phase };
			},
		});
		await c.start();
		try {
			const { rows } = await db.query(`SELECT token::text AS token FROM idempotency.idem_claim(key => $1,
				request => '{"amount": 7}', scope => $2, lease => interval '50 milliseconds', keep_request => true)`,
			[key, scope]);
			await db.query(`SELECT idempotency.idem_checkpoint($1, $2::bigint, 'charged', NULL, $3)`, [key, rows[0].token, scope]);
			/* (or the key taken over already, after a sweep of the background worker) */
			await waitFor(async () => (await db.query(`SELECT lease_until <= clock_timestamp() OR attempt > 1 AS ended
				FROM idempotency.keys WHERE scope = $1 AND key = $2`, [scope, key])).rows[0].ended, 'the lease to end');
			await db.query('SELECT * FROM idempotency.idem_sweep()');
			await waitFor(async () => (await row(key, scope))?.status === 'succeeded', 'the completer to finish the key');
			assert.deepEqual((await row(key, scope)).response_body.json, { attempt: 2, request: { amount: 7 }, phase: 'charged' });
			assert.equal(counted.count('finish'), 1, 'the finish went through the pooler');
		} finally {
			await c.stop();
		}
	});
});
