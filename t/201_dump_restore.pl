
# Copyright: the idempotency extension authors.
#
# 201_dump_restore.pl: keys, their stored results, scope bindings and the
# token sequence survive pg_dump | pg_restore (custom format) and a plain SQL
# dump replayed with psql, each into a fresh database.
#
# What it proves, for both formats:
#   - idempotency.keys is restored row for row, every column identical
#     (status, token, attempt, fingerprint, response code and body, every
#     timestamp, retention), and so are scope_bindings and the schema's USAGE
#     grants;
#   - every finished key replays the identical stored response through
#     idem_claim (same status, code and body), and a request with another
#     fingerprint (100 vs 100.0) is still a mismatch;
#   - the pending key is still pending (in_progress), and the token its
#     owner holds is still current: it finishes the key in the restored
#     database; a token that lost a takeover is still refused (55000);
#   - the restored bindings still confine each tenant role to its prefix
#     (42501 outside it);
#   - the token sequence is dumped: a new claim's token is larger than every
#     token the source database ever issued, including tokens of released
#     and rolled-back claims that no stored row carries.
#
# Run as described at the top of t/001_restart.pl (as the postgres OS user,
# with PG_REGRESS and PERL5LIB set).  Port 55444 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('dump', port => 55444,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ]);

$node->safe_psql('postgres', 'CREATE DATABASE src');
install_extension($node, 'src');
$node->safe_psql(
	'src', q{
CREATE ROLE tenant_a LOGIN;
CREATE ROLE tenant_b LOGIN;
GRANT USAGE ON SCHEMA idempotency TO tenant_a, tenant_b;
SELECT idempotency.bind_scope('tenant_a', 'a:');
SELECT idempotency.bind_scope('tenant_b', 'b:');
});

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# Every token the source database has handed out, committed or not.
my @tokens;
sub max_token { return max(0, @tokens); }

sub claimed
{
	my ($args, $role) = @_;
	my $c = claim($node, 'src', $args, role => $role);
	is($c->{outcome}, 'claimed', "src: claim($args) is claimed");
	cmp_ok($c->{token}, '>', max_token(), "src: claim($args) token is the largest so far");
	push @tokens, $c->{token};
	return $c;
}

# --- fill the source database ----------------------------------------------
my %body = (
	ok     => q{'{"order": 1, "total": 100.0, "items": [1, 2, 3]}'},
	failed => q{'{"error": "upstream timeout", "retry": false}'},
	a      => q{'{"tenant": "a", "text": "ünïcødé ✓ 😀 \"quoted\" back\\\\slash"}'},
	b      => q{'{"tenant": "b", "list": [null, true, 1e-7, -0.0]}'},
	num    => q{'{"amount": 100.0}'},
	taken  => q{'{"attempt": 2}'},
	late   => q{'{"late": "but alive"}'},
	big    => q{(SELECT jsonb_build_object('n', 6000, 'blob', }
	  . q{string_agg(md5(i::text), '' ORDER BY i)) }
	  . q{FROM generate_series(1, 6000) AS i)},
);
my %md5;
$md5{$_} = body_md5($node, 'src', $body{$_}) foreach keys %body;

# The keys compared column for column (sweep_at too) are claimed with a
# lease of an hour: the worker meets a finished key first when its claim's
# lease ends, and then moves its sweep_at, in the source or in a restored
# copy.
my $c;
$c = claimed(q{'ok-1', request => '{"order": 1}', retention => '30 days', lease => '1 hour'});
sql('src', "SELECT idempotency.idem_finish('ok-1', $c->{token}, 201, $body{ok})");

$c = claimed(q{'fail-1', request => '{"order": 2}', lease => '1 hour'});
sql('src',
	    "SELECT idempotency.idem_finish('fail-1', $c->{token}, 502, $body{failed}, "
	  . "status => 'failed', retention => '2 hours')");

# The same key in two tenants' scopes, claimed and finished by the tenants.
$c = claimed(q{'order-7', request => '{"sku": "x"}', scope => 'a:shop', lease => '1 hour'}, 'tenant_a');
sql('src',
	    "SET ROLE tenant_a; SELECT idempotency.idem_finish('order-7', $c->{token}, 200, "
	  . "$body{a}, scope => 'a:shop')");
$c = claimed(q{'order-7', request => '{"sku": "y"}', scope => 'b:shop', lease => '1 hour'}, 'tenant_b');
sql('src',
	    "SET ROLE tenant_b; SELECT idempotency.idem_finish('order-7', $c->{token}, 200, "
	  . "$body{b}, scope => 'b:shop')");

# No request, no response code, no body.
$c = claimed(q{'bare', lease => '1 hour'});
sql('src', "SELECT idempotency.idem_finish('bare', $c->{token})");

# A body stored out of line (TOAST).
$c = claimed(q{'big', scope => 'toast', lease => '1 hour'});
sql('src', "SELECT idempotency.idem_finish('big', $c->{token}, 200, $body{big}, scope => 'toast')");

# Numeric scale is part of the fingerprint.
$c = claimed(q{'num', request => '{"amount": 100.0}', scope => 'pay', lease => '1 hour'});
sql('src', "SELECT idempotency.idem_finish('num', $c->{token}, 200, $body{num}, scope => 'pay')");

# A takeover: attempt 1 runs out of lease, attempt 2 finishes.
$c = claimed(q{'retaken', request => '{"job": 9}', scope => 'q:orders', lease => '10 ms'});
my $dead_token = $c->{token};
ok(wait_lease_over($node, 'src', 'q:orders', 'retaken'),
	'src: the first attempt of q:orders/retaken ran out of lease');
$c = claimed(q{'retaken', request => '{"job": 9}', scope => 'q:orders', lease => '1 hour'});
is($c->{attempt}, 2, 'src: q:orders/retaken taken over as attempt 2');
sql('src',
	    "SELECT idempotency.idem_finish('retaken', $c->{token}, 200, $body{taken}, "
	  . "scope => 'q:orders')");

# The pending key, with a long lease; its owner keeps the token.
$c = claimed(q{'pending', request => '{"job": 1}', lease => '1 hour'});
my $pending_token = $c->{token};

# Tokens that no stored row carries: a released claim, a rolled-back claim.
$c = claimed(q{'released'});
sql('src', "SELECT idempotency.idem_release('released', $c->{token})");
my $rolled_back = sql('src',
	"BEGIN; SELECT token FROM idempotency.idem_claim('rolled-back'); ROLLBACK;");
like($rolled_back, qr/^\d+$/, 'src: a claim in a rolled-back transaction drew a token');
cmp_ok($rolled_back, '>', max_token(), 'src: the rolled-back token is the largest');
push @tokens, $rolled_back;

is(sql('src', "SELECT count(*) FROM idempotency.keys WHERE key IN ('released', 'rolled-back')"),
	'0', 'src: released and rolled-back claims left no row');
# With the library preloaded the sequence stands at the end of the block
# tokens are drawn from; without it, at the last token.
cmp_ok(sql('src', 'SELECT last_value FROM idempotency.token_seq'),
	'>=', max_token(), 'src: the sequence stands at or above the largest token issued');

# What must come back, column for column.
my $rows_sql =
    "SELECT string_agg(concat_ws('|', quote_literal(scope), quote_literal(key), "
  . "status, coalesce(token::text, 'NULL'), attempt, "
  . "coalesce(encode(fingerprint, 'hex'), 'NULL'), "
  . "coalesce(response_code::text, 'NULL'), coalesce(md5(response_body::text), 'NULL'), "
  . "created_at, coalesce(finished_at::text, 'NULL'), "
  . "coalesce(lease_until::text, 'NULL'), expires_at, retention, sweep_at), "
  . "E'\\n' ORDER BY scope, key) FROM idempotency.keys";
my $bindings_sql =
    "SELECT string_agg(role::text || '=' || scope_prefix, ',' ORDER BY role::text) "
  . "FROM idempotency.scope_bindings";
my $grants_sql =
    "SELECT has_schema_privilege('tenant_a', 'idempotency', 'USAGE')::text || ',' || "
  . "has_schema_privilege('tenant_b', 'idempotency', 'USAGE')::text || ',' || "
  . "has_function_privilege('tenant_a', 'idempotency.idem_sweep(integer)', 'EXECUTE')::text";
my $seq_sql = 'SELECT last_value || \',\' || is_called FROM idempotency.token_seq';

my %src = (
	rows     => sql('src', $rows_sql),
	bindings => sql('src', $bindings_sql),
	grants   => sql('src', $grants_sql),
	seq      => sql('src', $seq_sql),
	count    => sql('src', 'SELECT count(*) FROM idempotency.keys'),
	version  => sql('src', "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"));
is($src{count}, 9, 'src: nine stored keys');
# pg_tle lists the extensions it registered in pgtle.available_extensions(),
# not in pg_available_extensions.
my $available =
  $EDITION eq 'pgtle' ? 'pgtle.available_extensions()' : 'pg_available_extensions';
is( $src{version},
	sql('src', "SELECT default_version FROM $available WHERE name = 'idempotency'"),
	'src: the newest version is installed');
is($src{bindings}, 'tenant_a=a:,tenant_b=b:', 'src: two scope bindings');
is($src{grants}, 'true,true,false', 'src: tenants have USAGE, not idem_sweep');

# --- dump and restore ------------------------------------------------------
my $dir = PostgreSQL::Test::Utils::tempdir;
$node->command_ok(
	[ 'pg_dump', '-Fc', '-d', $node->connstr('src'), '-f', "$dir/src.dump" ],
	'pg_dump (custom format) of the source database');
$node->command_ok(
	[ 'pg_dump', '-Fp', '-d', $node->connstr('src'), '-f', "$dir/src.sql" ],
	'pg_dump (plain format) of the source database');

# From template0: with pg_tle, template1 has pg_tle and the registration of
# idempotency already, which the dump carries itself.
sql('postgres', 'CREATE DATABASE dst_custom TEMPLATE template0');
sql('postgres', 'CREATE DATABASE dst_plain TEMPLATE template0');
$node->command_ok(
	[
		'pg_restore', '--exit-on-error', '-d', $node->connstr('dst_custom'),
		"$dir/src.dump"
	],
	'pg_restore of the custom dump into a fresh database');
$node->command_ok(
	[
		'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-d', $node->connstr('dst_plain'),
		'-f', "$dir/src.sql"
	],
	'psql replays the plain dump into a fresh database');

# --- verify each restored database -----------------------------------------
foreach my $db ('dst_custom', 'dst_plain')
{
	is(sql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
		$src{version}, "$db: the extension is installed at the source's version");
	is(sql($db, $rows_sql), $src{rows}, "$db: every stored key is identical, column for column");
	is(sql($db, $bindings_sql), $src{bindings}, "$db: scope_bindings restored");
	is(sql($db, $grants_sql), $src{grants}, "$db: USAGE grants restored, idem_sweep still not granted");
	is(sql($db, $seq_sql), $src{seq}, "$db: the token sequence is where the source left it");
	is( sql($db,
			"SELECT concat_ws(',', pending, succeeded, failed) FROM idempotency.stats "
			  . "WHERE database = current_database()"),
		'1,7,1', "$db: stats counts 1 pending, 7 succeeded, 1 failed");

	# Every finished key replays its stored result.
	my @replays = (
		[ q{'ok-1', request => '{"order": 1}'}, 'succeeded', 201, $md5{ok} ],
		[ q{'fail-1', request => '{"order": 2}'}, 'failed', 502, $md5{failed} ],
		[ q{'bare'}, 'succeeded', undef, undef ],
		[ q{'big', scope => 'toast'}, 'succeeded', 200, $md5{big} ],
		[ q{'num', request => '{"amount": 100.0}', scope => 'pay'}, 'succeeded', 200, $md5{num} ],
		[ q{'retaken', request => '{"job": 9}', scope => 'q:orders'}, 'succeeded', 200, $md5{taken} ],
		[ q{'order-7', request => '{"sku": "x"}', scope => 'a:shop'}, 'succeeded', 200, $md5{a}, 'tenant_a' ],
		[ q{'order-7', request => '{"sku": "y"}', scope => 'b:shop'}, 'succeeded', 200, $md5{b}, 'tenant_b' ],
	);
	foreach my $r (@replays)
	{
		my ($args, $status, $code, $md5, $role) = @$r;
		is_deeply(
			claim($node, $db, $args, role => $role),
			replay_row($status, $code, $md5),
			"$db: claim($args) replays the stored $status result"
			  . (defined $role ? " (as $role)" : ''));
	}
	is( sql($db,
			"SELECT response_body->>'n' || ',' || length(response_body->>'blob') "
			  . "FROM idempotency.idem_claim('big', scope => 'toast')"),
		'6000,192000', "$db: the TOASTed body is whole, readable jsonb");
	is( sql($db,
			"SELECT response_body->>'text' FROM idempotency.idem_claim('order-7', "
			  . q{request => '{"sku": "x"}', scope => 'a:shop')}),
		'ünïcødé ✓ 😀 "quoted" back\\slash', "$db: the Unicode body reads back exactly");
	is(claim($node, $db, q{'num', request => '{"amount": 100}', scope => 'pay'})->{outcome},
		'mismatch', "$db: the stored fingerprint still tells 100 from 100.0");
	is(claim($node, $db, q{'ok-1', request => '{"order": 1, "x": 1}'})->{outcome},
		'mismatch', "$db: ok-1 with another request is a mismatch");
	is(claim($node, $db, q{'ok-1'})->{outcome}, 'mismatch',
		"$db: ok-1 without a request is a mismatch");

	# The pending key is still pending, under its owner's lease.
	$c = claim($node, $db, q{'pending', request => '{"job": 1}'});
	is($c->{outcome}, 'in_progress', "$db: the pending key answers in_progress");
	cmp_ok($c->{retry_after}, '>', 1, "$db: retry_after counts the restored lease");
	is( sql($db, "SELECT status || ',' || attempt FROM idempotency.idem_lookup('pending')"),
		'pending,1', "$db: lookup: pending, attempt 1");

	# The tenant bindings still hold.
	is(sqlstate_of($node, $db,
			"SET ROLE tenant_a; SELECT * FROM idempotency.idem_lookup('order-7', scope => 'b:shop')"),
		'42501', "$db: tenant_a may not look up b:shop (42501)");
	like(
		($node->psql($db,
				"SET ROLE tenant_a; SELECT * FROM idempotency.idem_claim('k', scope => 'b:x')"))[2],
		qr/permission denied for idempotency scope "b:x"/,
		"$db: the refusal is the scope binding, not a missing schema privilege");
	is(sqlstate_of($node, $db,
			"SET ROLE tenant_b; SELECT * FROM idempotency.idem_claim('k', scope => 'a:x')"),
		'42501', "$db: tenant_b may not claim in a:x (42501)");

	# New tokens continue above every token the source issued.
	$c = claim($node, $db, q{'new-after-restore', lease => '1 hour'});
	is($c->{outcome}, 'claimed', "$db: a new key is claimed");
	is($c->{attempt}, 1, "$db: as attempt 1");
	cmp_ok($c->{token}, '>', max_token(),
		"$db: its token is above every token the source issued (rolled back ones included)");
	my $first_new = $c->{token};
	$c = claim($node, $db, q{'new-2', scope => 'a:shop'}, role => 'tenant_a');
	cmp_ok($c->{token}, '>', $first_new, "$db: tokens keep increasing");

	# The restored tokens keep their meaning.
	my $row_before = sql($db,
		"SELECT status, token, response_code FROM idempotency.keys "
		  . "WHERE scope = 'q:orders' AND key = 'retaken'");
	is(sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('retaken', $dead_token, 500, scope => 'q:orders')"),
		'55000', "$db: the token that lost the takeover cannot finish (55000)");
	is( sql($db,
			"SELECT status, token, response_code FROM idempotency.keys "
			  . "WHERE scope = 'q:orders' AND key = 'retaken'"),
		$row_before, "$db: and changed nothing");
	is(sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('pending', $pending_token, 200, $body{late})"),
		'00000', "$db: the pending key's owner finishes it with its pre-dump token");
	$c = claim($node, $db, q{'pending', request => '{"job": 1}'});
	is($c->{outcome},  'replay',   "$db: the pending key now replays");
	is($c->{body_md5}, $md5{late}, "$db: with the late owner's body");
}

# The source database is untouched by the restores.
is(sql('src', $rows_sql), $src{rows}, 'src: unchanged by dump and restores');

$node->stop;
done_testing();
